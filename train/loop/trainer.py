"""The generic training loop: any registered model, any registered data set, one config.

`Trainer(cfg)` sets a run up, in order: mesh -> data pipelines -> model and optimizer, born
sharded under the mesh (`zoo.engine.loop.build`) -> split once into graphdef + state -> jitted steps.
`fit()` runs the loop to its end; `steps()` is the same loop as a generator, so a caller (a
benchmark) can advance it a few steps at a time. A run, in order:

  1. Open it (`Trainer._open`): hold the workdir; restore the run or start it (its own
     checkpoint, another run's weights, its seed: `zoo.engine.checkpoints.start`); write its
     config and log there; open its event file and announce it (`zoo.engine.report.announce`).
  2. The host loop (`Trainer._train`), one dispatch of K steps (`zoo.engine.loop.dispatch`) at a
     time up to `trainer.steps`; at each:
     a. get the next K batches;
     b. dispatch the K jitted train steps, the probes due before them (`zoo.engine.report.observe`);
     c. the actions due at the dispatch's last step (`zoo.engine.loop.cadence`): close the log
        window (and report the one before it: metrics, probes, `on_train_window`); evaluate
        (then `trainer.early_stop`, `on_eval`); checkpoint (every `checkpoint_every`, at the
        last step, an early stop, a signal or a callback's stop; `on_checkpoint` once it is
        complete); stop on a signal (`zoo.engine.loop.signals`) or a callback's request.
  3. Finish: wait for the last save; `fit()` logs the final eval and calls `on_end`.
  4. Close, in reverse order: event file, checkpointer, data iterator, log, workdir.

A fine-tune is such a run too: its config's `finetune` section adds LoRA adapters to the built
model, limits what the optimizer and the gradients see to the trainable params, and (on a fresh
start, not on a resume) fills the model with another run's weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from omegaconf import DictConfig, OmegaConf
from zoo.engine import posttraining, registry
from zoo.engine.checkpoints import starting_state
from zoo.engine.checkpoints.manager import Checkpointer
from zoo.engine.checkpoints.start import RunStart, resumes, start_run, warm_start_on_build
from zoo.engine.errors import ZooError
from zoo.engine.loop import rundir
from zoo.engine.loop.build import build_on_mesh
from zoo.engine.loop.cadence import Cadence, Every, LogWindows
from zoo.engine.loop.callbacks import Callbacks
from zoo.engine.loop.config_checks import check_data, check_packing
from zoo.engine.loop.dispatch import Dispatcher
from zoo.engine.loop.early_stop import EarlyStop
from zoo.engine.loop.rollout_batches import RolloutBatches
from zoo.engine.loop.signals import StopRequests
from zoo.engine.pipeline import batches as pipeline
from zoo.engine.report import memory
from zoo.engine.report.announce import announce_run
from zoo.engine.report.observe import Deferred, Instruments, ProfileWindow, WindowClock
from zoo.engine.report.reporter import EvalReport, Reporter, format_metrics
from zoo.engine.sharding import distributed
from zoo.engine.sharding import mesh as sharding
from zoo.engine.steps import precision
from zoo.engine.steps import rngs as zoo_rngs
from zoo.engine.steps.functions import COUNT, Metrics, Trainable, make_steps, means, zero_metrics
from zoo.engine.steps.histograms import make_histogram_step
from zoo.engine.steps.norms import make_norms_step
from zoo.engine.steps.optim import make_optimizer
from zoo.engine.steps.precision import compute_loss
from zoo.engine.weights import ema
from zoo.engine.weights.freeze import (
    Filter,
    check_frozen,
    frozen_filter,
    frozen_norms,
    trainable_filter,
)

if TYPE_CHECKING:
    import grain

log = logging.getLogger("zoo")


@dataclasses.dataclass
class RunResult:
    """What a finished run hands back: the trained model (in eval mode) and where it lives."""

    model: nnx.Module
    state: nnx.State  # model and optimizer state, as the checkpoints hold it
    eval_metrics: dict[str, float]
    step: int
    workdir: str
    config: DictConfig
    mesh: jax.sharding.Mesh
    rules: sharding.AxisRules
    start_step: int = 0  # the checkpoint's step this run resumed from; 0: a fresh start

    def activate(self):
        """The mesh and rules the model was trained under: call the model inside it."""
        return sharding.activate(self.mesh, self.rules)


def run(cfg: DictConfig) -> RunResult:
    """Train `cfg.model` on `cfg.data` as the config says; write everything under `cfg.workdir`."""
    return Trainer(cfg).fit()


class Trainer:
    """One run. `devices` restricts the mesh to some of the devices (default: all of them).

    `data` replaces the registered data set that `cfg.data` names with the caller's own splits
    (columns of arrays or random-access sources; `cfg.model` must then give every parameter the
    data would have decided). `freeze` is an NNX filter of params to freeze, in place of the
    pattern `cfg.finetune.freeze`. `callbacks`: see `zoo.engine.loop.callbacks`."""

    def __init__(
        self,
        cfg: DictConfig,
        devices: Sequence[Any] | None = None,
        data: registry.Splits | None = None,
        freeze: Filter | None = None,
        callbacks: Sequence[Any] = (),
        rewards: Sequence[Callable[..., Sequence[Any]]] = (),
    ):
        self.cfg, trainer = cfg, cfg.trainer
        self.callbacks = Callbacks(callbacks)
        self.workdir = os.path.abspath(cfg.workdir)
        distributed.initialize(cfg)
        self.mesh, self.rules = sharding.mesh_and_rules(cfg.mesh, devices)
        _check_batch_split(trainer.batch_size, trainer.grad_accum_steps, self.mesh, self.rules)
        entry = registry.get_model(cfg.model.name)
        splits = self._set_up_data(entry, data)
        frozen = frozen_filter(cfg.finetune, freeze)
        trainable = trainable_filter(cfg.finetune, frozen)
        tx, self.schedule = make_optimizer(cfg.optimizer, trainer.steps)
        checkpoints = os.path.join(self.workdir, "checkpoints")
        self.warm_start = warm_start_on_build(cfg, self.hparams, self.mesh, self.rules, checkpoints)
        # A reference of the starting weights (preference and reward methods) needs them made.
        restores = resumes(cfg, checkpoints) and posttraining.reference_source(cfg.finetune) is None
        built = build_on_mesh(
            entry,
            self.hparams,
            cfg.seed,
            self.mesh,
            self.rules,
            finetune=cfg.finetune,
            tx=tx,
            wrt=trainable,
            prefill=self.warm_start,
            abstract=restores,
        )
        what = f"finetune.freeze={cfg.finetune.freeze}" if freeze is None else f"{freeze!r}"
        check_frozen(built.model, frozen, trainable, what)
        self.plan = built.plan
        self.param_count = sum(x.size for x in jax.tree.leaves(nnx.state(built.model, nnx.Param)))
        self.trainable = Trainable(
            trainable, frozen_norms(built.model, trainable), int(trainer.grad_accum_steps)
        )
        # Split once; from here on `self.state` is the single owner of the arrays.
        self.graphdef, self.state = nnx.split((built.model, built.optimizer))
        self._set_up_steps(entry, trainable)
        self.rollout_batches = self._set_up_rollouts(entry, splits, rewards)
        self.reference: Callable | None = None  # reference=copy: see `_open`
        self.class_names = splits.class_names or (
            registry.get_data(cfg.data.name).class_names
            if cfg.data.name in registry.list_datasets()
            else None
        )
        self.step_key, self.eval_key = zoo_rngs.step_key(cfg.seed), zoo_rngs.eval_key(cfg.seed)

    def _set_up_data(
        self, entry: registry.ModelEntry, data: registry.Splits | None
    ) -> registry.Splits:
        """The run's data pipelines, and the model's constructor arguments its data decides."""
        cfg, trainer = self.cfg, self.cfg.trainer
        splits, self.hparams = _splits_and_hparams(cfg, entry, data)
        self.splits = splits
        pipeline.check_host_memory(splits, trainer.batch_size, trainer.steps_per_dispatch)
        self.tokenizer = splits.tokenizer
        self.prompts = splits.prompts or tuple
        self.train_data, self.eval_data = pipeline.process_pipelines(
            splits, trainer.batch_size, cfg.seed
        )
        posttraining.check_method(cfg.finetune, self.eval_data[0])
        return splits

    def _set_up_steps(self, entry: registry.ModelEntry, trainable: Filter) -> None:
        """The jitted functions of the split state: train and eval steps, the dispatch of K
        train steps, the probes, the EMA-averaged params."""
        trainer = self.cfg.trainer
        self.skip_nonfinite = (
            OmegaConf.to_container(trainer, enum_to_str=True)["nan_policy"] == "skip"
        )
        objective = posttraining.training_objective(self.cfg.finetune, entry.loss)
        loss = compute_loss(objective, trainer.precision)
        self.jitted = make_steps(self.graphdef, loss, self.trainable, self.skip_nonfinite)
        self.train_step, self.eval_step = self.jitted.train, self.jitted.eval
        self.dispatcher = Dispatcher(
            self.train_step, trainer.steps_per_dispatch, self.mesh, self.rules
        )
        self.norms_step = make_norms_step(self.graphdef, self.jitted)
        self.histogram_step = make_histogram_step(self.graphdef, self.jitted)
        self.on_eval = entry.on_eval
        self.ema_decay = self.cfg.optimizer.ema_decay
        self.averaged = jax.jit(
            lambda state: ema.averaged(self.graphdef, state, trainable, self.ema_decay)
        )

    def _set_up_rollouts(
        self, entry: registry.ModelEntry, splits: registry.Splits, given: Sequence[Callable]
    ) -> RolloutBatches | None:
        """`finetune.method=grpo`: how each step's batch is sampled (None for the others)."""
        if posttraining.method_of(self.cfg.finetune) != posttraining.GRPO:
            return None
        options = posttraining.grpo_options(self.cfg.finetune)
        functions = posttraining.reward_functions(options, given)
        if entry.sample is None:
            raise ZooError(
                f"finetune.method=grpo samples completions, which model '{entry.name}' cannot "
                "write: use a language model (gpt, decoder)."
            )
        rollouts = posttraining.Rollouts(
            options,
            functions,
            posttraining.reward_names(functions),
            entry.sample,
            splits.tokenizer,
            splits.records or {},
            tuple(splits.end_of_turn),
        )
        computes = self.cfg.trainer.precision
        return RolloutBatches(rollouts, self.graphdef, computes, self.shard, self.cfg.seed)

    def _set_up_reference(self, source: str) -> None:
        """The reference log-probabilities the loss reads as a column, from the starting
        weights (a resumed run takes them again from `finetune.init_from`): `precomputed`,
        every pair's once, joined to the data; `copy`, each batch's, from a frozen copy of the
        weights kept on the devices (`with_reference`)."""
        start = starting_state(self.cfg, self.graphdef, self.state, self.hparams)
        graph, weights = nnx.split(nnx.merge(self.graphdef, start)[0])  # no optimizer state
        computes = self.cfg.trainer.precision
        scores = posttraining.reference_logps(self.cfg.finetune)

        @jax.jit
        def logps(weights, batch):
            model = nnx.merge(graph, weights)
            model.eval()
            return scores(precision.computing(model, computes), batch)

        if source == posttraining.COPY:  # arrays of its own: the train step donates the state's
            with sharding.activate(self.mesh, self.rules):
                frozen = jax.tree.map(jnp.copy, weights)
            self.reference = functools.partial(logps, frozen)
            return
        batch_size, seed = self.cfg.trainer.batch_size, self.cfg.seed
        with sharding.activate(self.mesh, self.rules):
            joined = posttraining.with_reference_logps(
                self.splits, batch_size, lambda batch: logps(weights, self.shard(batch))
            )
        self.train_data, self.eval_data = pipeline.process_pipelines(joined, batch_size, seed)

    def with_reference(self, batch: Mapping[str, Any]) -> Mapping[str, Any]:
        """`batch` with the frozen copy's log-probabilities of it, where the run keeps one
        (`finetune.dpo.reference=copy`, `finetune.grpo.reference=copy`; a host batch's on the
        host)."""
        if self.reference is None:
            return batch
        on_host = isinstance(batch["tokens"], np.ndarray)
        logps = self.reference(self.shard(batch) if on_host else batch)
        column = np.asarray(jax.device_get(logps)) if on_host else logps
        return {**batch, posttraining.REFERENCE_LOGPS: column}

    def shard(self, batch: dict[str, Any]) -> dict[str, jax.Array]:
        return sharding.shard_batch(batch, self.mesh, self.rules)

    def evaluate(self, ema: bool = False) -> dict[str, float]:
        """Mean metrics over every eval example, each counted once; `ema`: of the averaged
        params (`optimizer.ema_decay`) in place of the trained ones."""
        with sharding.activate(self.mesh, self.rules):
            state = self.averaged(self.state) if ema else self.state
            batches = map(self.with_reference, self.eval_data)
            if self.rollout_batches is not None:  # completions sampled by the policy evaluated
                step = self.progress.step if hasattr(self, "progress") else 0
                sampled = self.rollout_batches.evaluation(state, self.eval_data, step)
                batches = list(map(self.with_reference, sampled))
        return evaluate_batches(
            self.eval_step, state, batches, self.mesh, self.rules, self.eval_key
        )

    def eval_metric_names(self) -> list[str]:
        with sharding.activate(self.mesh, self.rules):
            batch = self.eval_data[0]
            if self.rollout_batches is not None:
                batch = self.rollout_batches.placeholder(batch)
            batch = self.shard(posttraining.reference_placeholder(self.cfg.finetune, batch))
            shapes = jax.eval_shape(self.eval_step, self.state, {}, batch, self.eval_key)
        return sorted(name for name in shapes if name != COUNT)

    def fit(
        self, overrides: Sequence[str] | None = None, run_log: rundir.RunLog | None = None
    ) -> RunResult:
        """Train to `trainer.steps` (resuming where the workdir's checkpoints say); `overrides`
        (the command line's) are recorded in the workdir with the config; `run_log`, begun
        before this trainer was built, holds the lines logged since (else they start here)."""
        for _ in self.steps(overrides, run_log):
            pass
        done = self.progress
        log.info("Final eval @ step %d: %s", done.eval_step, format_metrics(done.eval_metrics))
        model, _ = nnx.merge(self.graphdef, self.state, copy=True)
        model.eval()
        result = RunResult(
            model,
            self.state,
            done.eval_metrics,
            done.step,
            self.workdir,
            self.cfg,
            self.mesh,
            self.rules,
            start_step=self.resumed_from,
        )
        self.callbacks("on_end", result)
        if self.callbacks.failure is not None:
            raise self.callbacks.halt(result.step, None)
        return result

    def steps(
        self, overrides: Sequence[str] | None = None, run_log: rundir.RunLog | None = None
    ) -> Iterator[int]:
        """The training loop of `fit()`, yielding each step's number once the step is
        dispatched (not finished); closing the generator early closes the run's checkpointer
        and event writer without a final eval or checkpoint."""
        with self._open(overrides, run_log) as cadence:
            yield from self._train(cadence)

    def _train(self, cadence: Cadence) -> Iterator[int]:
        """The host loop: from the step the run starts at to `trainer.steps`, K steps per
        dispatch, then the actions due at the dispatch's last step, in this order.

        The mesh is current only while a dispatch and its actions are made: the caller's code
        between two yields runs outside it, and a generator left unfinished leaves no mesh
        behind."""
        every, k, instruments = cadence.every, self.dispatcher.k, cadence.instruments
        first, sums = cadence.progress.step + k, cadence.progress.window
        if cadence.ended_early:  # resumed at the checkpoint an early stop ended the run with
            return
        with cadence.signals.installed(), instruments.installed():
            for step in range(first, every.total + 1, k):  # the dispatch's last step
                with sharding.activate(self.mesh, self.rules):
                    # 1. The next K batches: the iterator's position always matches `step`.
                    with cadence.windows.clock.waiting_for_data():
                        batches = self._next_batches(cadence.iterator, step)
                    # 2. The K jitted train steps, dispatched: the host does not wait for them.
                    if step == first and not self.cfg.trainer.debug:  # log its compiled memory
                        args = (self.state, sums, batches, self.step_key)
                        memory.announce(self.dispatcher.run, args, k, cadence.reporter, step - k)
                    instruments.before(step, self.state, batches, self.step_key)  # probes due
                    with instruments.profile.marker(step):
                        self.state, sums = self.dispatcher.run(
                            self.state, sums, batches, self.step_key
                        )
                    instruments.after(step, sums)
                    # 3. The actions due at `step`.
                    cadence.checkpointer.poll()  # a save failed in the background: stop here
                    if every.closes_window(step):
                        sums = cadence.close_log_window(step, sums)
                    if every.evaluates(step):
                        metrics = cadence.evaluate(step)
                        if cadence.stops_early(step, metrics):
                            sums = cadence.close_last_window(step, sums)
                        cadence.callbacks("on_eval", step, metrics)
                    signal = cadence.signals.due(step // k)  # the same on every process
                    halting = signal is not None or cadence.callbacks.halting
                    if every.saves(step) or halting or cadence.ended_early:
                        cadence.save_checkpoint(step, self.state, sums)
                    if halting:
                        raise cadence.halt(step, signal)
                    cadence.progress.step = step
                yield step
                if cadence.ended_early:
                    break
        cadence.finish()

    def _next_batches(self, iterator: Any, step: int) -> Any:
        """The input of the dispatch ending at `step`: the next batches of the data, or for
        `finetune.method=grpo` the batch of completions the policy samples now."""
        if self.rollout_batches is None:
            return self.with_reference(next(iterator))
        return self.rollout_batches.training(self.state, iterator, step, self.with_reference)

    @contextlib.contextmanager
    def _open(
        self, overrides: Sequence[str] | None, run_log: rundir.RunLog | None
    ) -> Iterator[Cadence]:
        """The run, opened: the workdir held for the run's life, the state restored (or
        started), then the config, the log and the events written there; closed in reverse
        order, the last save waited for, however the loop ends."""
        saved_config = OmegaConf.to_container(self.cfg, resolve=True, enum_to_str=True)
        self._check_eval_metric("best_metric", saved_config["trainer"]["best_metric"])
        self._check_eval_metric(
            "early_stop.metric", saved_config["trainer"]["early_stop"]["metric"]
        )
        primary = jax.process_index() == 0
        with contextlib.ExitStack() as stack:
            if self.cfg.trainer.debug:
                stack.enter_context(debugging())
            stack.enter_context(rundir.hold(self.workdir, jax.process_index()))
            self.callbacks.record_in(self.workdir, jax.process_index())
            run_log = run_log or stack.enter_context(rundir.RunLog())
            source = posttraining.reference_source(self.cfg.finetune)
            if source is not None:
                self._set_up_reference(source)
            iterator = self.dispatcher.iterate(self.train_data)  # a prefetch thread starts on use
            stack.callback(iterator.close)
            checkpointer = self._checkpointer(saved_config)
            stack.callback(checkpointer.close)  # waits for the last save, the log still open
            zeros = self._start(checkpointer, iterator, saved_config)
            if primary:
                rundir.record(self.workdir, self.cfg, overrides, self.tokenizer)
            run_log.write_to(self.workdir)
            total = int(self.cfg.trainer.steps)
            reporter = Reporter(self.workdir, total, start_step=self.resumed_from, primary=primary)
            stack.callback(reporter.close)
            self._announce(reporter, saved_config)
            yield self._cadence(reporter, checkpointer, iterator, saved_config, zeros)

    def _checkpointer(self, saved_config: dict[str, Any]) -> Checkpointer:
        trainer = saved_config["trainer"]
        return Checkpointer(
            os.path.join(self.workdir, "checkpoints"),
            keep=trainer["keep"],
            best_metric=trainer["best_metric"],
            best_mode=trainer["best_mode"],
        )

    def _start(self, checkpointer: Checkpointer, iterator, saved_config) -> Metrics:
        """Restore (or start) the run; the zero window sums of its train step."""
        with sharding.activate(self.mesh, self.rules):
            example = pipeline.peek(self.train_data)
            if self.rollout_batches is not None:
                example = self.rollout_batches.placeholder(example)
            example = self.shard(posttraining.reference_placeholder(self.cfg.finetune, example))
            zeros = zero_metrics(self.train_step, self.state, {}, example, self.step_key)
            how = RunStart(
                self.cfg,
                saved_config,
                self.graphdef,
                self.state,
                iterator,
                zeros,
                self.step_key,
                self.hparams,
                self.warm_start,
            )
            self.state, self.progress = start_run(how, checkpointer)
        self.resumed_from = self.progress.step
        self._check_start_step(self.progress.step, checkpointer.directory)
        return zeros

    def _check_start_step(self, step: int, where: str) -> None:
        k, total = self.dispatcher.k, int(self.cfg.trainer.steps)
        if step % k:
            raise ZooError(
                f"trainer.steps_per_dispatch={k} cannot resume at step {step}, where the "
                f"checkpoint in {where} is: the loop dispatches K steps at a time from there and "
                f"must land on every cadence. Use a steps_per_dispatch that divides {step} (1 "
                "always does)."
            )
        if step > total:
            raise ZooError(
                f"trainer.steps={total} is below step {step}, where the checkpoint in {where} "
                f"already is; use trainer.steps >= {step}."
            )

    def _check_eval_metric(self, key: str, metric: str | None) -> None:
        if metric and metric not in self.eval_metric_names():
            raise ZooError(
                f"trainer.{key}={metric} is not an eval metric of model "
                f"'{self.cfg.model.name}'; valid: {', '.join(self.eval_metric_names())}."
            )

    def _announce(self, reporter: Reporter, saved_config: dict[str, Any]) -> None:
        announce_run(
            reporter,
            cfg=self.cfg,
            saved_config=saved_config,
            model=nnx.merge(self.graphdef, self.state)[0],  # shares the arrays; read only
            plan=self.plan,
            eval_metrics=self.eval_metric_names(),
            start_step=self.resumed_from,
            stopped_early=self.progress.early_stop.get("stopped", False),
            mesh=self.mesh,
            param_count=self.param_count,
            workdir=self.workdir,
        )

    def _cadence(
        self,
        reporter: Reporter,
        checkpointer: Checkpointer,
        iterator: grain.DatasetIterator,
        saved_config: dict[str, Any],
        zeros: Metrics,
    ) -> Cadence:
        """What the loop does besides stepping: measure around each dispatch, and act at the
        cadences (log windows, eval, checkpoints, stop requests)."""
        progress, trainer = self.progress, self.cfg.trainer
        clock = WindowClock(progress.step, int(trainer.batch_size))
        return Cadence(
            every=Every.of(trainer),
            progress=progress,
            iterator=iterator,
            windows=LogWindows(clock=clock, schedule=self.schedule, start=progress.window_start),
            instruments=self._instruments(reporter, progress.step),
            reporter=reporter,
            evaluate_and_report=lambda step: self._evaluate_and_report(step, reporter),
            checkpointer=checkpointer,
            saved_config=saved_config,
            meta={"seed": self.cfg.seed, "base_key": jax.random.key_data(self.step_key).tolist()},
            zeros=zeros,
            skip_nonfinite=self.skip_nonfinite,
            early_stop=EarlyStop.of(saved_config["trainer"]["early_stop"], progress.early_stop),
            callbacks=self.callbacks,
            signals=StopRequests(),
        )

    def _instruments(self, reporter: Reporter, start: int) -> Instruments:
        k = self.dispatcher.k
        first = start + k

        def every(n: int) -> Callable[[int], bool]:
            """Every n steps, and at the run's first step: a run shorter than n samples too."""
            return lambda s: bool(n) and (s % n == 0 or s == first)

        probes = [
            Deferred(
                self.norms_step,
                every(int(self.cfg.logging.norms_every)),
                lambda s, norms: reporter.scalars("vitals", s, norms),
            ),
            Deferred(
                self.histogram_step,
                every(int(self.cfg.logging.histogram_every)),
                reporter.histograms,
            ),
        ]
        return Instruments(
            profile=ProfileWindow(self.workdir, list(self.cfg.trainer.profile_steps)),
            probes=probes,
            steps_per_dispatch=k,
            first_step=first,
            compiled_before=self.progress.compiles,
            devices=self.mesh.local_devices,
        )

    def _evaluate_and_report(self, step: int, reporter: Reporter) -> dict[str, float]:
        """The eval at `step`, to TensorBoard and the console, then the model's own report
        (samples, images), if it registered one."""
        metrics = self.evaluate()
        reporter.eval(step, metrics)
        if self.rollout_batches is not None:
            reporter.text("completions", self.rollout_batches.table, step)
        if self.ema_decay is not None:
            averaged = self.evaluate(ema=True)
            reporter.scalars("val_ema", step, averaged)
            log.info("Eval (EMA weights) @ step %d: %s", step, format_metrics(averaged))
        reports = self.on_eval is not None and self.cfg.logging.eval_reports
        if reports and self.rollout_batches is None:  # grpo: its completions instead
            model, _ = nnx.merge(self.graphdef, self.state)  # shares the arrays; read only
            model.eval()
            model = precision.computing(model, self.cfg.trainer.precision)  # as the eval
            key = zoo_rngs.on_eval_key(self.cfg.seed, step)

            def batches():
                return (self.shard(batch) for batch in self.eval_data)

            report = EvalReport(
                step,
                key,
                posttraining.shown_examples(self.cfg.finetune, self.eval_data[0]),
                reporter,
                batches,
                self.tokenizer,
                self.class_names,
                self.prompts,
            )
            self.on_eval(model, report)
        return metrics


@contextlib.contextmanager
def debugging() -> Iterator[None]:
    """`trainer.debug`: every step as plain Python, op by op, stopping at the first NaN."""
    log.info(
        "trainer.debug: steps run un-jitted with NaN checks (jax_debug_nans), slowly; print(), "
        "breakpoint() and jax.debug.print work inside the model."
    )
    with jax.disable_jit(), jax.debug_nans(True):
        yield


def _check_batch_split(
    batch_size: int, microbatches: int, mesh: jax.sharding.Mesh, rules: sharding.AxisRules
):
    shards = sharding.batch_divisor(mesh, rules)
    if microbatches > 1 and batch_size % (shards * microbatches):
        raise ZooError(
            f"trainer.batch_size={batch_size} cannot be split into trainer.grad_accum_steps="
            f"{microbatches} microbatches that each split over the mesh's batch axes (data*fsdp "
            f"= {shards}); use a batch_size that is a multiple of {shards * microbatches}, or "
            "another grad_accum_steps."
        )
    if batch_size % shards:
        raise ZooError(
            f"trainer.batch_size={batch_size} cannot be split over the mesh's batch axes "
            f"(data*fsdp = {shards}); use a multiple of {shards}."
        )


def _splits_and_hparams(
    cfg: DictConfig, entry: registry.ModelEntry, data: registry.Splits | None
) -> tuple[registry.Splits, dict[str, Any]]:
    """The run's data and its model's constructor arguments (those its data set decides
    filled in; the caller's own data decides nothing)."""
    hparams = OmegaConf.to_container(cfg.model)
    if data is not None:
        check_data(entry, data, hparams)
        return data, hparams
    data_entry = registry.get_data(cfg.data.name)
    params = OmegaConf.to_container(cfg.data)
    splits = data_entry.splits(params)
    check_packing(entry, splits)
    return splits, entry.resolve(hparams, data_entry, params)


def evaluate_batches(
    eval_step: Callable,
    state: Any,
    batches: Iterable[dict[str, Any]],
    mesh: jax.sharding.Mesh,
    rules: sharding.AxisRules,
    key: jax.Array,
) -> dict[str, float]:
    """Mean metrics of `eval_step` over masked eval batches (`zoo.engine.pipeline.batches.eval_batches`).

    One step runs ahead of the host at most: with a longer queue of eval steps, jaxlib 0.10's
    XLA:CPU on 8 devices left some devices out of a step's all-reduce and aborted the run (128
    eval batches of a tiny gpt did; jaxlib 0.12 does not). The host readies the next batch while
    the step before it runs, so nothing waits on the host."""
    with sharding.activate(mesh, rules):
        sums: Metrics | None = None
        for host_batch in batches:
            batch = sharding.shard_batch(host_batch, mesh, rules)
            if sums is None:
                sums = zero_metrics(eval_step, state, {}, batch, key)
            sums = eval_step(state, jax.block_until_ready(sums), batch, key)
        return means(sums)

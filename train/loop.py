"""The generic training loop: any registered model, any registered data set, one config.

`Trainer(cfg)` sets a run up, in order: mesh -> data pipelines -> model and optimizer, born
sharded under the mesh -> split once into graphdef + state -> jitted steps. `fit()` is one
linear loop: a batch, a step, and at their cadences a log window, an eval and a checkpoint.
`steps()` is the same loop as a generator, so a caller (a benchmark) can advance it a few steps
at a time.

A fine-tune is such a run too: its config's `finetune` section adds LoRA adapters to the built
model, limits what the optimizer and the gradients see to the trainable params, and (on a fresh
start, not on a resume) fills the model with another run's weights.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
from flax import nnx
from omegaconf import DictConfig, OmegaConf

from data import pipeline
from train import distributed, resume, sharding
from train import rngs as zoo_rngs
from train.checkpoint import FORMAT as CHECKPOINT_FORMAT
from train.checkpoint import Checkpointer, abstract_like, read_json
from train.dispatch import Dispatcher
from train.freeze import Filter, frozen_filter, frozen_norms, trainable_filter
from train.histograms import make_histogram_step
from train.lora import add_adapters
from train.norms import make_norms_step
from train.observe import CompileWatch, Deferred, ProfileWindow, WindowClock
from train.optim import make_optimizer
from train.plan import create_sharded
from train.report import EvalReport, Reporter, format_metrics
from train.signals import Interrupted, StopRequests
from train.steps import (
    COUNT,
    Metrics,
    Trainable,
    health,
    make_eval_step,
    make_train_step,
    means,
    zero_metrics,
)
from train.summaries import hparams_summaries, model_summary
from train.warm_start import locate, warm_start
from zoo import registry
from zoo.config import resume_step
from zoo.errors import ZooError

log = logging.getLogger("zoo")

# How many steps the host may dispatch ahead of the devices. A few keep every device busy; more
# buy nothing but memory, and with 8 simulated CPU devices deep queues (hundreds of tiny steps)
# occasionally deadlocked XLA:CPU's all-reduce rendezvous (about 1 run in 3 of 1,954 XOR steps).
MAX_STEPS_IN_FLIGHT = 8
_timing_log = logging.getLogger("train.timing")  # train.log only, not the console


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


def build_model(
    entry: registry.ModelEntry, hparams: dict[str, Any], seed: int, finetune: Any
) -> nnx.Module:
    """The model a run's config describes: the registered model, with the LoRA adapters that
    `finetune` asks for. Call it under the mesh, so everything is born sharded."""
    model = entry.build(hparams, zoo_rngs.init_rngs(seed))
    if finetune.lora_rank:
        add_adapters(model, finetune.lora_rank, finetune.lora_layers, zoo_rngs.adapter_rngs(seed))
    return model


def run(cfg: DictConfig) -> RunResult:
    """Train `cfg.model` on `cfg.data` as the config says; write everything under `cfg.workdir`."""
    return Trainer(cfg).fit()


class Trainer:
    """One run. `devices` restricts the mesh to some of the devices (default: all of them).

    `data` replaces the registered data set that `cfg.data` names with the caller's own splits
    (columns of arrays or random-access sources; `cfg.model` must then give every parameter the
    data would have decided). `freeze` is an NNX filter of params to freeze, in place of the
    pattern `cfg.finetune.freeze`."""

    def __init__(
        self,
        cfg: DictConfig,
        devices: Sequence[Any] | None = None,
        data: registry.Splits | None = None,
        freeze: Filter | None = None,
    ):
        self.cfg = cfg
        trainer = cfg.trainer
        model_entry = registry.get_model(cfg.model.name)
        self.workdir = os.path.abspath(cfg.workdir)

        distributed.initialize(cfg)
        self.rules = sharding.AxisRules.from_mapping(cfg.mesh.rules)
        self.mesh = sharding.make_mesh(cfg.mesh, devices)
        shards = sharding.batch_divisor(self.mesh, self.rules)
        if trainer.batch_size % shards:
            raise ZooError(
                f"trainer.batch_size={trainer.batch_size} cannot be split over the mesh's batch "
                f"axes (data*fsdp = {shards}); use a multiple of {shards}."
            )

        hparams = OmegaConf.to_container(cfg.model)
        if data is None:
            data_entry = registry.get_data(cfg.data.name)
            splits = data_entry.splits(OmegaConf.to_container(cfg.data))
            hparams = model_entry.resolve(hparams, data_entry)
        else:
            splits = data
        process, processes = jax.process_index(), jax.process_count()
        self.train_data = pipeline.train_batches(
            splits.train,
            trainer.batch_size,
            cfg.seed,
            shard_index=process,
            shard_count=processes,
            transform=splits.transform,
            augment=splits.augment,
        )
        self.eval_data = pipeline.eval_batches(
            splits.eval,
            trainer.batch_size,
            shard_index=process,
            shard_count=processes,
            transform=splits.transform,
        )

        finetune = cfg.finetune
        trainable = trainable_filter(finetune, frozen_filter(finetune, freeze))
        with sharding.activate(self.mesh, self.rules):
            tx, self.schedule = make_optimizer(cfg.optimizer, trainer.steps)

            def create():
                model = build_model(model_entry, hparams, cfg.seed, finetune)
                return model, nnx.Optimizer(model, tx, wrt=trainable)

            (model, optimizer), self.plan = create_sharded(create, self.mesh, self.rules)
            self.param_count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
            self.trainable = Trainable(trainable, frozen_norms(model, trainable))
            # Split once; from here on `self.state` is the single owner of the arrays.
            self.graphdef, self.state = nnx.split((model, optimizer))
        policy = OmegaConf.to_container(trainer, enum_to_str=True)["nan_policy"]
        self.skip_nonfinite = policy == "skip"
        self.train_step = make_train_step(
            self.graphdef, model_entry.loss, self.skip_nonfinite, self.trainable
        )
        self.dispatcher = Dispatcher(
            self.train_step, trainer.steps_per_dispatch, self.mesh, self.rules
        )
        self.eval_step = make_eval_step(self.graphdef, model_entry.loss)
        self.norms_step = make_norms_step(self.graphdef, model_entry.loss)
        self.histogram_step = make_histogram_step(self.graphdef, model_entry.loss)
        self.on_eval = model_entry.on_eval
        self.step_key, self.eval_key = zoo_rngs.step_key(cfg.seed), zoo_rngs.eval_key(cfg.seed)

    def shard(self, batch: dict[str, Any]) -> dict[str, jax.Array]:
        return sharding.shard_batch(batch, self.mesh, self.rules)

    def evaluate(self) -> dict[str, float]:
        """Mean metrics over every eval example, each counted once."""
        return evaluate_batches(
            self.eval_step, self.state, self.eval_data, self.mesh, self.rules, self.eval_key
        )

    def eval_metric_names(self) -> list[str]:
        with sharding.activate(self.mesh, self.rules):
            batch = self.shard(self.eval_data[0])
            shapes = jax.eval_shape(self.eval_step, self.state, {}, batch, self.eval_key)
        return sorted(name for name in shapes if name != COUNT)

    def fit(self) -> RunResult:
        for _ in self.steps():
            pass
        start = self.progress
        log.info("Final eval @ step %d: %s", start.eval_step, format_metrics(start.eval_metrics))
        model, _ = nnx.merge(self.graphdef, self.state, copy=True)
        model.eval()
        return RunResult(
            model,
            self.state,
            start.eval_metrics,
            int(self.cfg.trainer.steps),
            self.workdir,
            self.cfg,
            self.mesh,
            self.rules,
            start_step=self.resumed_from,
        )

    def steps(self) -> Iterator[int]:
        """The training loop of `fit()`, yielding each step's number once the step is
        dispatched (not finished); closing the generator early closes the run's checkpointer
        and event writer without a final eval or checkpoint."""
        cfg, trainer = self.cfg, self.cfg.trainer
        total = int(trainer.steps)
        config_dict = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        settings = config_dict["trainer"]
        if settings["best_metric"] and settings["best_metric"] not in self.eval_metric_names():
            raise ZooError(
                f"trainer.best_metric={settings['best_metric']} is not an eval metric of model "
                f"'{cfg.model.name}'; valid: {', '.join(self.eval_metric_names())}."
            )
        checkpointer = Checkpointer(
            os.path.join(self.workdir, "checkpoints"),
            keep=settings["keep"],
            best_metric=settings["best_metric"],
            best_mode=settings["best_mode"],
        )
        iterator = self.dispatcher.iterate(self.train_data)  # a prefetch thread starts on use
        reporter = None
        try:
            with sharding.activate(self.mesh, self.rules):
                example = self.shard(next(iter(self.train_data)))  # a fresh iterator: a peek
                zeros = zero_metrics(self.train_step, self.state, {}, example, self.step_key)
                start = self._resume(checkpointer, iterator, zeros, config_dict)
            self.progress, self.resumed_from = start, start.step
            k = self.dispatcher.k
            if start.step % k:
                raise ZooError(
                    f"trainer.steps_per_dispatch={k} cannot resume at step {start.step}, where "
                    f"the checkpoint in {checkpointer.directory} is: the loop dispatches K steps "
                    f"at a time from there and must land on every cadence. Use a "
                    f"steps_per_dispatch that divides {start.step} (1 always does)."
                )
            if start.step > total:
                raise ZooError(
                    f"trainer.steps={total} is below step {start.step}, where the checkpoint in "
                    f"{checkpointer.directory} already is; use trainer.steps >= {start.step}."
                )
            reporter = Reporter(
                self.workdir, total, start_step=start.step, primary=jax.process_index() == 0
            )
            config_text = _as_markdown_code(OmegaConf.to_yaml(cfg, resolve=True))
            reporter.text("config", config_text, step=start.step)
            reporter.text("sharding_plan", _as_markdown_code(self.plan.table()), step=start.step)
            model, _ = nnx.merge(self.graphdef, self.state)  # shares the arrays; read only
            reporter.text("model_summary", _as_markdown_code(model_summary(model)), step=start.step)
            metric_tags = [f"eval/{name}" for name in self.eval_metric_names()]
            reporter.summaries(hparams_summaries(config_dict, [*metric_tags, "train/loss"]))
            log.info(
                "%s %s on %s for %d steps (batch %d) on mesh %s; %s parameters; workdir %s",
                (
                    ("Already complete: " if start.step == total else "")
                    + f"Resuming at step {start.step}: training"
                )
                if start.step
                else "Training",
                cfg.model.name,
                cfg.data.name,
                total,
                trainer.batch_size,
                dict(self.mesh.shape),
                f"{self.param_count:,}",
                self.workdir,
            )
            log.info("%s", self.plan.table())
            yield from self._loop(start, iterator, zeros, checkpointer, reporter, config_dict)
        finally:
            iterator.close()
            checkpointer.close()
            if reporter is not None:
                reporter.close()

    def _loop(self, run, iterator, zeros, checkpointer, reporter, config_dict) -> Iterator[int]:
        """Steps `run.step + 1 .. trainer.steps`; `run` (a `_Progress`) is updated as it goes."""
        trainer = self.cfg.trainer
        # Plain ints: the loop reads them every step, and a config lookup costs microseconds.
        total, log_every = int(trainer.steps), int(trainer.log_every)
        eval_every, checkpoint_every = int(trainer.eval_every), int(trainer.checkpoint_every)
        clock = WindowClock(run.step, int(trainer.batch_size))
        compiles = CompileWatch()
        norms_every = int(self.cfg.logging.norms_every)
        every = int(self.cfg.logging.histogram_every)

        def closes_window(step: int) -> bool:
            return step % log_every == 0 or step == total

        probes = [
            Deferred(
                self.norms_step,
                lambda s: norms_every and s % norms_every == 0,
                lambda s, norms: reporter.scalars("train", s, norms),
            ),
            Deferred(self.histogram_step, lambda s: every and s % every == 0, reporter.histograms),
        ]
        profile = ProfileWindow(self.workdir, list(trainer.profile_steps))

        def report_extras(step: int) -> None:
            reporter.scalars("compile", step, compiles.totals())
            for probe in probes:
                probe.write(up_to=step)

        windows = _LogWindows(
            reporter,
            self.schedule,
            checkpointer,
            clock,
            report_extras,
            run.window_start,
            self.skip_nonfinite,
        )
        sums = run.window
        stop = StopRequests()
        key_data = jax.random.key_data(self.step_key).tolist()
        in_flight: collections.deque[jax.Array] = collections.deque()
        k = self.dispatcher.k
        with (
            stop.installed(),
            compiles.installed(),
            contextlib.closing(profile),
            sharding.activate(self.mesh, self.rules),
        ):
            first = run.step + k
            for step in range(run.step + k, total + 1, k):  # `step` counts the batches consumed
                # Exactly one batch per step: the iterator's state always matches the step.
                with clock.waiting_for_data():
                    batches = next(iterator)
                dispatched = range(step - k + 1, step + 1)
                for s in dispatched:
                    profile.before_step(s)
                if k == 1:  # the probes need the state before each step: not inside a scan
                    for probe in probes:
                        probe.before_step(step, self.state, batches, self.step_key)
                self.state, sums = self.dispatcher.run(self.state, sums, batches, self.step_key)
                if step == first:  # compiled (on a first run) and running
                    _timing_log.info("First dispatch of this run: steps %d-%d", step - k + 1, step)
                for s in dispatched:
                    profile.after_step(s, sums)
                in_flight.append(sums[COUNT])
                if len(in_flight) > MAX_STEPS_IN_FLIGHT:
                    in_flight.popleft().block_until_ready()
                if closes_window(step):
                    windows.close(step, sums)
                    sums = zeros
                if (eval_every and step % eval_every == 0) or step == total:
                    windows.report_pending()
                    run.eval_metrics, run.eval_step = self.evaluate(), step
                    reporter.eval(step, run.eval_metrics)
                    self._on_eval(step, reporter)
                due = checkpoint_every and step % checkpoint_every == 0
                if due or step == total or stop.signum is not None:
                    # Never save a state that a NaN/Inf loss has reached (nan_policy=stop).
                    windows.report_pending()
                    windows.check(sums)
                    meta = {
                        "seed": self.cfg.seed,
                        "base_key": key_data,
                        "window_start": windows.window_start,
                        "eval": {"step": run.eval_step, "metrics": run.eval_metrics},
                    }
                    started = time.perf_counter()
                    checkpointer.save(
                        step,
                        self.state,
                        iterator,
                        config_dict,
                        window=sums,
                        meta=meta,
                        metrics=run.eval_metrics if run.eval_step == step else None,
                    )
                    _timing_log.info(
                        "Checkpoint %d: %.3f s blocking", step, time.perf_counter() - started
                    )
                if stop.signum is not None:
                    raise Interrupted(stop.signum, step, checkpointer.step_path(step))
                run.step = step
                yield step

    def _on_eval(self, step: int, reporter: Reporter) -> None:
        """The model's own report after an eval (samples, images), if it registered one."""
        if self.on_eval is None:
            return
        model, _ = nnx.merge(self.graphdef, self.state)  # shares the arrays; read only
        model.eval()
        key = zoo_rngs.on_eval_key(self.cfg.seed, step)

        def batches():
            return (self.shard(batch) for batch in self.eval_data)

        self.on_eval(model, EvalReport(step, key, self.eval_data[0], reporter, batches))

    def _resume(self, checkpointer, iterator, zeros, config_dict) -> _Progress:
        """Where the loop starts: the restored checkpoint that `trainer.resume` picks, or step 0.
        Restores the state (resharded onto this run's mesh), the window sums and the iterator."""
        fresh = _Progress(step=0, window=zeros, window_start=0, eval_step=0, eval_metrics={})
        steps = resume.candidates(checkpointer, str(self.cfg.trainer.resume))
        explicit = resume_step(self.cfg.trainer.resume) is not None
        unreadable: list[tuple[int, str]] = []
        for step in steps:
            path = checkpointer.step_path(step)
            saved_config, error = _read(checkpointer.restore_config, step)
            if error is None:
                resume.check_config(step, path, saved_config, config_dict)
                started = time.perf_counter()
                restored, error = _read(
                    checkpointer.restore,
                    step,
                    abstract_like(self.state),
                    iterator,
                    abstract_like(zeros),
                )
            if error is not None:
                unreadable.append((step, error))
                if explicit:
                    break
                continue
            self._check_meta(step, path, restored["meta"])
            for bad_step, why in unreadable:
                aside = checkpointer.set_aside(bad_step)
                log.warning(
                    "Checkpoint at step %d (%s) cannot be read (%s); kept as %s. "
                    "Falling back to step %d.",
                    bad_step,
                    checkpointer.step_path(bad_step),
                    why,
                    aside,
                    step,
                )
            _timing_log.info(
                "Restored step %d from %s in %.3f s",
                step,
                path,
                time.perf_counter() - started,
            )
            self.state = restored["state"]
            meta = restored["meta"]
            return _Progress(
                step=step,
                window=restored["window"],
                window_start=int(meta["window_start"]),
                eval_step=int(meta["eval"]["step"]),
                eval_metrics=dict(meta["eval"]["metrics"]),
            )
        if unreadable and explicit:
            step, why = unreadable[0]
            raise ZooError(
                f"Cannot resume from trainer.resume={step}: the checkpoint at "
                f"{checkpointer.step_path(step)} cannot be read ({why}). Nothing was changed; "
                "trainer.resume=auto falls back to the latest readable earlier step."
            )
        if unreadable:
            details = "; ".join(
                f"step {s} at {checkpointer.step_path(s)}: {w}" for s, w in unreadable
            )
            raise ZooError(
                f"Cannot resume: no checkpoint in {checkpointer.directory} can be read "
                f"({details}). Nothing was changed; move the damaged checkpoints away to start "
                "over, or use another workdir."
            )
        if self.cfg.finetune.init_from is not None:
            self._warm_start()
        return fresh

    def _warm_start(self) -> None:
        """A fresh fine-tune: params and BatchNorm statistics from `finetune.init_from`."""
        finetune = self.cfg.finetune
        step, path = locate(finetune.init_from, finetune.init_step)
        trained = read_json(path, "config")["model"]["name"]
        if trained != self.cfg.model.name:
            raise ZooError(
                f"finetune.init_from={finetune.init_from} holds a '{trained}' model, but this "
                f"run builds '{self.cfg.model.name}': use model={trained}."
            )
        model, optimizer = nnx.merge(self.graphdef, self.state)
        fresh = warm_start(model, path, list(finetune.reinit), option="finetune.reinit")
        self.state = nnx.state((model, optimizer))
        log.info(
            "Starting from %s (step %d)%s",
            path,
            step,
            f"; initialised afresh: {', '.join(fresh)}" if fresh else "",
        )

    def _check_meta(self, step: int, path: str, meta: dict[str, Any]) -> None:
        expected = jax.random.key_data(self.step_key).tolist()
        if meta.get("format") != CHECKPOINT_FORMAT or meta.get("base_key") != expected:
            raise ZooError(
                f"The checkpoint at step {step} ({path}) was written by an incompatible version "
                f"of zoo (format {meta.get('format')}, expected {CHECKPOINT_FORMAT}; or another "
                "base PRNG key for this seed). Use another workdir to start a new run."
            )


def evaluate_batches(
    eval_step: Callable,
    state: Any,
    batches: Iterable[dict[str, Any]],
    mesh: jax.sharding.Mesh,
    rules: sharding.AxisRules,
    key: jax.Array,
) -> dict[str, float]:
    """Mean metrics of `eval_step` over masked eval batches (`data.pipeline.eval_batches`)."""
    with sharding.activate(mesh, rules):
        sums: Metrics | None = None
        for host_batch in batches:
            batch = sharding.shard_batch(host_batch, mesh, rules)
            if sums is None:
                sums = zero_metrics(eval_step, state, {}, batch, key)
            sums = eval_step(state, sums, batch, key)
        return means(sums)


@dataclasses.dataclass
class _Progress:
    """Where a run is: the last step done, the open log window, the last eval."""

    step: int
    window: Metrics
    window_start: int
    eval_step: int
    eval_metrics: dict[str, float]


class NonFiniteLoss(ZooError):
    """The training loss became NaN or Inf under `trainer.nan_policy=stop`."""


class _LogWindows:
    """Training metrics, summed on device over each window of `log_every` steps.

    A closed window is fetched only when the next one closes (or an eval or a checkpoint needs
    it), by which time the device has long finished it: the host never waits on the device to
    log. The open window's sums go into checkpoints, so a resumed run logs the same numbers."""

    def __init__(
        self,
        reporter: Reporter,
        schedule: Callable,
        checkpointer: Checkpointer,
        clock: WindowClock,
        report_extras: Callable[[int], None],
        window_start: int,
        skip_nonfinite: bool,
    ):
        self._reporter = reporter
        self._checkpointer = checkpointer
        self._clock = clock
        self._report_extras = report_extras  # called with each reported window's last step
        self._learning_rate = jax.jit(schedule)  # one compilation, not one per eager op
        self._pending: tuple[int, int, Metrics, dict[str, Any]] | None = None
        self._skip = skip_nonfinite
        self.window_start = window_start  # the open window holds steps window_start+1 ...

    def close(self, step: int, sums: Metrics) -> None:
        # The learning rate is dispatched now and read with the window, a window later.
        speed = {**self._clock.lap(step), "learning_rate": self._learning_rate(step - 1)}
        window = (self.window_start, step, sums, speed)
        self.window_start = step
        self.report_pending()
        self._pending = window

    def report_pending(self) -> None:
        if self._pending is None:
            return
        start, step, sums, speed = self._pending
        self._pending = None
        self._check_health(start, step, sums)
        metrics = means(sums)
        metrics["learning_rate"] = float(speed.pop("learning_rate"))
        self._reporter.train_window(step, metrics, speed)
        self._report_extras(step)

    def check(self, sums: Metrics) -> None:
        """Before a checkpoint: stop if the open window met a NaN/Inf loss (nan_policy=stop)."""
        if not self._skip:
            self._check_health(self.window_start, None, sums)

    def _check_health(self, start: int, end: int | None, sums: Metrics) -> None:
        bad, first = health(sums)
        if not bad:
            return
        if self._skip:
            log.warning(
                "Skipped %d update(s) with a NaN or Inf train/loss in steps %d-%d, the first at "
                "step %d (trainer.nan_policy=skip).",
                bad,
                start + 1,
                end,
                start + first,
            )
            return
        self._pending = None
        step = self._checkpointer.latest_step()
        last = (
            "Stopped; no checkpoint had been saved."
            if step is None
            else f"Stopped without saving a later state: the last good checkpoint is step {step} "
            f"({self._checkpointer.step_path(step)})."
        )
        raise NonFiniteLoss(
            f"train/loss became NaN or Inf at step {start + first} "
            f"(trainer.nan_policy=stop). {last} Lower the learning rate, or resume with "
            "trainer.nan_policy=skip to drop such updates."
        )


def _read(load: Callable[..., Any], *args: Any) -> tuple[Any, str | None]:
    """`(load(*args), None)`, or `(None, why)` when the checkpoint cannot be read at all."""
    # Before the read: a failing read's siblings report the closed loop as soon as it fails.
    resume.quiet_closed_loop_noise()
    try:
        return load(*args), None
    except Exception as e:  # noqa: BLE001  (any read failure: the caller tries an older step)
        return None, resume.reason(e)


def _as_markdown_code(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())

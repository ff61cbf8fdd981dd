"""The generic training loop: any registered model, any registered data set, one config.

`Trainer(cfg)` sets a run up, in order: mesh -> data pipelines -> model and optimizer, born
sharded under the mesh -> split once into graphdef + state -> jitted steps. `fit()` is one
linear loop: a batch, a step, and at their cadences a log window, an eval and a checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx
from omegaconf import DictConfig, OmegaConf

from data import pipeline
from train import distributed, sharding
from train import rngs as zoo_rngs
from train.checkpoint import Checkpointer
from train.optim import make_optimizer
from train.plan import create_sharded
from train.report import Reporter, format_metrics
from train.steps import Metrics, make_eval_step, make_train_step, means, zero_metrics
from zoo import registry
from zoo.errors import ZooError

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

    def activate(self):
        """The mesh and rules the model was trained under: call the model inside it."""
        return sharding.activate(self.mesh, self.rules)


def run(cfg: DictConfig) -> RunResult:
    """Train `cfg.model` on `cfg.data` as the config says; write everything under `cfg.workdir`."""
    return Trainer(cfg).fit()


class Trainer:
    """One run. `devices` restricts the mesh to some of the devices (default: all of them)."""

    def __init__(self, cfg: DictConfig, devices: Sequence[Any] | None = None):
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

        splits = registry.get_data(cfg.data.name).splits(OmegaConf.to_container(cfg.data))
        process, processes = jax.process_index(), jax.process_count()
        self.train_data = pipeline.train_batches(
            splits.train, trainer.batch_size, cfg.seed, shard_index=process, shard_count=processes
        )
        self.eval_data = pipeline.eval_batches(
            splits.eval, trainer.batch_size, shard_index=process, shard_count=processes
        )

        with sharding.activate(self.mesh, self.rules):
            tx, self.schedule = make_optimizer(cfg.optimizer, trainer.steps)
            hparams = OmegaConf.to_container(cfg.model)

            def create():
                model = model_entry.build(hparams, zoo_rngs.init_rngs(cfg.seed))
                return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

            (model, optimizer), self.plan = create_sharded(create, self.mesh, self.rules)
            self.param_count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
            # Split once; from here on `self.state` is the single owner of the arrays.
            self.graphdef, self.state = nnx.split((model, optimizer))
        self.train_step = make_train_step(self.graphdef, model_entry.loss)
        self.eval_step = make_eval_step(self.graphdef, model_entry.loss)
        self.step_key, self.eval_key = zoo_rngs.step_key(cfg.seed), zoo_rngs.eval_key(cfg.seed)

    def shard(self, batch: dict[str, Any]) -> dict[str, jax.Array]:
        return sharding.shard_batch(batch, self.mesh, self.rules)

    def evaluate(self) -> dict[str, float]:
        """Mean metrics over every eval example, each counted once."""
        with sharding.activate(self.mesh, self.rules):
            sums: Metrics | None = None
            for host_batch in self.eval_data:
                batch = self.shard(host_batch)
                if sums is None:
                    sums = zero_metrics(self.eval_step, self.state, {}, batch, self.eval_key)
                sums = self.eval_step(self.state, sums, batch, self.eval_key)
            return means(sums)

    def fit(self) -> RunResult:
        cfg, trainer = self.cfg, self.cfg.trainer
        total = int(trainer.steps)
        reporter = Reporter(self.workdir, total, primary=jax.process_index() == 0)
        checkpointer = Checkpointer(os.path.join(self.workdir, "checkpoints"))
        config_dict = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        windows = _LogWindows(reporter, self.schedule)
        eval_metrics: dict[str, float] = {}
        try:
            reporter.text("config", _as_markdown_code(OmegaConf.to_yaml(cfg, resolve=True)))
            reporter.text("sharding_plan", _as_markdown_code(self.plan.table()))
            log.info(
                "Training %s on %s for %d steps (batch %d) on mesh %s; %s parameters; workdir %s",
                cfg.model.name,
                cfg.data.name,
                total,
                trainer.batch_size,
                dict(self.mesh.shape),
                f"{self.param_count:,}",
                self.workdir,
            )
            log.info("%s", self.plan.table())
            iterator = iter(self.train_data)
            zeros: Metrics | None = None
            with sharding.activate(self.mesh, self.rules):
                for step in range(1, total + 1):  # `step` counts the updates done after it
                    # Exactly one batch per step: the iterator's state always matches the step.
                    batch = self.shard(next(iterator))
                    if zeros is None:
                        sums = zeros = zero_metrics(
                            self.train_step, self.state, {}, batch, self.step_key
                        )
                    self.state, sums = self.train_step(self.state, sums, batch, self.step_key)
                    if step % trainer.log_every == 0 or step == total:
                        windows.close(step, sums)
                        sums = zeros
                    if (trainer.eval_every and step % trainer.eval_every == 0) or step == total:
                        windows.report_pending()
                        eval_metrics = self.evaluate()
                        reporter.eval(step, eval_metrics)
                    if (
                        trainer.checkpoint_every and step % trainer.checkpoint_every == 0
                    ) or step == total:
                        checkpointer.save(step, self.state, iterator, config_dict)
        finally:
            checkpointer.close()
            reporter.close()

        log.info("Final eval @ step %d: %s", total, format_metrics(eval_metrics))
        model, _ = nnx.merge(self.graphdef, self.state, copy=True)
        model.eval()
        return RunResult(
            model, self.state, eval_metrics, total, self.workdir, cfg, self.mesh, self.rules
        )


class _LogWindows:
    """Training metrics, summed on device over each window of `log_every` steps.

    A closed window is fetched only when the next one closes (or an eval needs the console), by
    which time the device has long finished it: the host never waits on the device to log."""

    def __init__(self, reporter: Reporter, schedule: Callable):
        self._reporter = reporter
        self._learning_rate = jax.jit(schedule)  # one compilation, not one per eager op
        self._pending: tuple[int, Metrics, float] | None = None
        self._start_step, self._start_time = 0, time.perf_counter()

    def close(self, step: int, sums: Metrics) -> None:
        now = time.perf_counter()
        window = (step, sums, (step - self._start_step) / (now - self._start_time))
        self._start_step, self._start_time = step, now
        self.report_pending()
        self._pending = window

    def report_pending(self) -> None:
        if self._pending is None:
            return
        step, sums, steps_per_sec = self._pending
        self._pending = None
        metrics = means(sums)
        metrics["learning_rate"] = float(self._learning_rate(step - 1))
        self._reporter.train_window(step, metrics, {"steps_per_sec": steps_per_sec})


def _as_markdown_code(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())

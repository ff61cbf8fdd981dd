"""The generic training loop: any registered model, any registered data set, one config.

Sections, in order: config checks -> mesh -> data -> model and optimizer born sharded under the
mesh -> split once into graphdef + state -> the loop (jitted steps over pure state; metrics
fetched one log window late so the host never waits on the device) -> eval -> checkpoints ->
final summary.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
from flax import nnx
from omegaconf import DictConfig, OmegaConf

from data import pipeline
from train import rngs as zoo_rngs
from train import sharding
from train.checkpoint import Checkpointer
from train.optim import make_optimizer
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


def run(cfg: DictConfig) -> RunResult:
    """Train `cfg.model` on `cfg.data` as the config says; write everything under `cfg.workdir`."""
    trainer = cfg.trainer
    model_entry = registry.get_model(cfg.model.name)
    data_entry = registry.get_data(cfg.data.name)
    workdir = os.path.abspath(cfg.workdir)
    os.makedirs(workdir, exist_ok=True)

    mesh = sharding.make_mesh(cfg.mesh)
    shards = sharding.batch_divisor(mesh)
    if trainer.batch_size % shards:
        raise ZooError(
            f"trainer.batch_size={trainer.batch_size} cannot be split over the mesh's batch axes "
            f"(data*fsdp = {shards}); use a multiple of {shards}."
        )

    splits = data_entry.splits(OmegaConf.to_container(cfg.data))
    process, processes = jax.process_index(), jax.process_count()
    train_data = pipeline.train_batches(
        splits.train, trainer.batch_size, seed=cfg.seed, shard_index=process, shard_count=processes
    )
    eval_data = pipeline.eval_batches(
        splits.eval, trainer.batch_size, shard_index=process, shard_count=processes
    )

    with sharding.activate(mesh):
        tx, schedule = make_optimizer(cfg.optimizer, trainer.steps)
        hparams = OmegaConf.to_container(cfg.model)

        @nnx.jit
        def create():
            model = model_entry.build(hparams, zoo_rngs.init_rngs(cfg.seed))
            return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

        model, optimizer = create()
        param_count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
        graphdef, state = nnx.split((model, optimizer))
        del model, optimizer  # from here on, `state` is the single owner of the arrays
        train_step = make_train_step(graphdef, model_entry.loss)
        eval_step = make_eval_step(graphdef, model_entry.loss)
        step_key, eval_key = zoo_rngs.step_key(cfg.seed), zoo_rngs.eval_key(cfg.seed)

        def shard(batch: Mapping[str, Any]) -> dict[str, jax.Array]:
            return sharding.shard_batch(batch, mesh)

        def evaluate(state: Any) -> dict[str, float]:
            batches: Iterable[dict[str, jax.Array]] = map(shard, eval_data)
            sums: Metrics | None = None
            for batch in batches:
                if sums is None:
                    sums = zero_metrics(eval_step, state, {}, batch, eval_key)
                sums = eval_step(state, sums, batch, eval_key)
            return means(sums)

        config_dict = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
        reporter = Reporter(workdir, trainer.steps)
        checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"))
        try:
            reporter.text("config", _as_markdown_code(OmegaConf.to_yaml(cfg, resolve=True)))
            log.info(
                "Training %s on %s for %d steps (batch %d) on mesh %s; %s parameters; workdir %s",
                cfg.model.name,
                cfg.data.name,
                trainer.steps,
                trainer.batch_size,
                dict(mesh.shape),
                f"{param_count:,}",
                workdir,
            )
            state, eval_metrics = _loop(
                trainer,
                state,
                iter(train_data),
                shard,
                train_step,
                step_key,
                schedule,
                evaluate,
                reporter,
                checkpointer,
                config_dict,
            )
        finally:
            checkpointer.close()
            reporter.close()

    log.info("Final eval @ step %d: %s", trainer.steps, format_metrics(eval_metrics))
    model, _ = nnx.merge(graphdef, state, copy=True)
    model.eval()
    return RunResult(model, state, eval_metrics, int(trainer.steps), workdir, cfg)


def _loop(
    trainer: Any,
    state: Any,
    iterator: Any,
    shard: Callable,
    train_step: Callable,
    step_key: jax.Array,
    schedule: Callable,
    evaluate: Callable,
    reporter: Reporter,
    checkpointer: Checkpointer,
    config_dict: dict[str, Any],
) -> tuple[Any, dict[str, float]]:
    total = int(trainer.steps)
    learning_rate = jax.jit(schedule)  # one compilation instead of one per eager op
    eval_metrics: dict[str, float] = {}
    zeros: Metrics | None = None
    sums: Metrics = {}
    # A log window closes every `log_every` steps; its sums are fetched when the next window
    # closes (or before an eval), by which time the device has long finished them.
    pending: tuple[int, Metrics, float] | None = None
    window_start, window_time = 0, time.perf_counter()

    def report(window: tuple[int, Metrics, float]) -> None:
        step, window_sums, steps_per_sec = window
        metrics = means(window_sums)
        metrics["learning_rate"] = float(learning_rate(step - 1))
        reporter.train_window(step, metrics, {"steps_per_sec": steps_per_sec})

    for step in range(1, total + 1):  # `step` counts the updates done once this iteration ends
        # The iterator yields exactly one batch per step, so a checkpoint's iterator state
        # always matches its step.
        batch = shard(next(iterator))
        if zeros is None:
            sums = zeros = zero_metrics(train_step, state, {}, batch, step_key)
        state, sums = train_step(state, sums, batch, step_key)
        if step % trainer.log_every == 0 or step == total:
            now = time.perf_counter()
            window = (step, sums, (step - window_start) / (now - window_time))
            window_start, window_time, sums = step, now, zeros
            if pending is not None:
                report(pending)
            pending = window
        if (trainer.eval_every and step % trainer.eval_every == 0) or step == total:
            if pending is not None:
                report(pending)
                pending = None
            eval_metrics = evaluate(state)
            reporter.eval(step, eval_metrics)
        if (trainer.checkpoint_every and step % trainer.checkpoint_every == 0) or step == total:
            checkpointer.save(step, state, iterator, config_dict)
    return state, eval_metrics


def _as_markdown_code(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())

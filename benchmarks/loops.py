"""The training loops the benchmark compares, each advanced a window of steps at a time.

Every loop trains the same model (the zoo trainer's own initial state, copied), with the same
optimizer, on batches of the same data and size. A loop is a callable `advance(n)` that runs n
steps and returns only once the devices have finished them (`block_until_ready`).
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from zoo.engine import registry
from zoo.engine.loop.trainer import Trainer
from zoo.engine.sharding import mesh as sharding
from zoo.engine.steps import rngs as zoo_rngs

Advance = Callable[[int], None]

IN_MEMORY_BATCHES = 16
"""Batches the hand-written loops cycle through, placed on the devices once, up front."""


def host_batches(trainer: Trainer, count: int = IN_MEMORY_BATCHES) -> list[dict[str, np.ndarray]]:
    """The first `count` batches of the trainer's own pipeline, as host arrays."""
    iterator = iter(trainer.train_data)
    return [next(iterator) for _ in range(count)]


def device_batches(
    trainer: Trainer, host: list[dict[str, np.ndarray]]
) -> list[dict[str, jax.Array]]:
    """`host` batches placed on the trainer's mesh once, up front."""
    with sharding.activate(trainer.mesh, trainer.rules):
        return [trainer.shard(batch) for batch in host]


def pipeline_rate(trainer: Trainer, batches: int) -> float:
    """Batches/s that the trainer's own pipeline delivers onto the devices, placement included
    (what each zoo step waits for before its dispatch)."""
    iterator = iter(trainer.train_data)
    with sharding.activate(trainer.mesh, trainer.rules):
        next(iterator)
        start = time.perf_counter()
        for _ in range(batches):
            placed = trainer.shard(next(iterator))
        jax.block_until_ready(placed)
    return batches / (time.perf_counter() - start)


def data_wait_shares(workdir: str) -> list[float]:
    """`vitals/data_wait_share` of every log window the trainer in `workdir` wrote but the
    first (compilation, warm-up)."""
    events = EventAccumulator(workdir)
    events.Reload()
    if "vitals/data_wait_share" not in events.Tags()["scalars"]:
        return []  # no window was reported
    return [event.value for event in events.Scalars("vitals/data_wait_share")[1:]]


def _mean_loss(loss_fn: registry.LossFn) -> Callable:
    """The model's registered loss as a batch mean of a model in train mode."""

    def objective(model, batch):
        loss, _ = loss_fn(model, batch, zoo_rngs.call_rngs(jax.random.key(0), 0))
        return jnp.mean(loss)

    return objective


def _own_copy(trainer: Trainer) -> tuple[nnx.Module, nnx.Optimizer]:
    """(model, optimizer) as the trainer starts, in arrays of their own: the trainer donates
    its state's buffers to each step."""
    with sharding.activate(trainer.mesh, trainer.rules):
        return nnx.merge(trainer.graphdef, jax.tree.map(jnp.copy, trainer.state))


def zoo_loop(trainer: Trainer) -> Advance:
    """The zoo trainer's real loop (pipeline, sharding of batches, metric sums, log windows,
    TensorBoard), advanced through `Trainer.steps()`; `n` must be a multiple of
    `trainer.steps_per_dispatch`."""
    steps = trainer.steps()
    k = trainer.dispatcher.k

    def advance(n: int) -> None:
        for _ in range(n // k):  # `steps()` yields once per dispatch of k steps
            next(steps)
        jax.block_until_ready(trainer.state)

    advance.close = steps.close  # type: ignore[attr-defined]
    return advance


def bare_loop(trainer: Trainer, batches: list[dict[str, jax.Array]]) -> Advance:
    """The limit of a per-step loop: `jax.jit` of a pure function of (graphdef, state), split
    once, state donated, batches already in memory, nothing fetched."""
    objective = _mean_loss(registry.get_model(trainer.cfg.model.name).loss)
    graphdef, state = nnx.split(_own_copy(trainer))

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        model.train()
        grads = nnx.grad(objective)(model, batch)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer))

    cycle = itertools.cycle(batches)
    holder = [state]

    def advance(n: int) -> None:
        with sharding.activate(trainer.mesh, trainer.rules):
            for _ in range(n):
                holder[0] = step(holder[0], next(cycle))
        jax.block_until_ready(holder[0])

    return advance


def nnx_tutorial_loop(trainer: Trainer, batches: list[dict[str, jax.Array]]) -> Advance:
    """The loop that NNX's tutorials teach: `nnx.jit` with the model and the optimizer passed as
    arguments on every step."""
    objective = _mean_loss(registry.get_model(trainer.cfg.model.name).loss)
    model, optimizer = _own_copy(trainer)
    model.train()

    @nnx.jit
    def step(model, optimizer, batch):
        grads = nnx.grad(objective)(model, batch)
        optimizer.update(model, grads)

    cycle = itertools.cycle(batches)

    def advance(n: int) -> None:
        with sharding.activate(trainer.mesh, trainer.rules):
            for _ in range(n):
                step(model, optimizer, next(cycle))
        jax.block_until_ready(nnx.state((model, optimizer)))

    return advance

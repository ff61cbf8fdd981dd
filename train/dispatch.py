"""`trainer.steps_per_dispatch=K`: K train steps per call from the host, in one `lax.scan`.

A tiny model's step takes less device time than the host needs to fetch a batch, place it and
dispatch the step. Stacking K batches into one transfer and running K steps in one jitted scan
divides that host cost by K. The scan's body is the same train step, so metrics still
accumulate step by step and the bits equal K separate steps'; the loop only sees the state
every K steps, which is why every cadence must be a multiple of K.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from train import sharding
from zoo.errors import ZooError

CADENCES = ("steps", "log_every", "eval_every", "checkpoint_every")
"""Trainer settings the loop acts on at step boundaries: each a multiple of K (0: off)."""


def check_cadences(trainer: Mapping[str, Any]) -> None:
    """Refuse a `steps_per_dispatch` that is below 1 or does not divide every cadence."""
    k = trainer["steps_per_dispatch"]
    if k < 1:
        raise ZooError(
            f"trainer.steps_per_dispatch={k} must be at least 1 (1: one step per dispatch)."
        )
    bad = [f"trainer.{key}={trainer[key]}" for key in CADENCES if trainer[key] % k]
    if bad:
        raise ZooError(
            f"trainer.steps_per_dispatch={k} must divide {', '.join(bad)}: the loop sees the "
            f"state only every {k} steps. Use multiples of {k} there, or a steps_per_dispatch "
            "that divides them all (1 always does)."
        )


class Dispatcher:
    """Fetches, places and runs the next K steps' batches: `state, sums = run(state, sums,
    batches, key)` with `batches = next_batches(iterator)`."""

    def __init__(
        self,
        train_step: Callable,
        steps_per_dispatch: int,
        mesh: jax.sharding.Mesh,
        rules: sharding.AxisRules,
    ):
        self.k = steps_per_dispatch
        self._mesh, self._rules = mesh, rules
        self.run = train_step if self.k == 1 else _scanned(train_step)

    def next_batches(self, iterator: Iterator[Mapping[str, np.ndarray]]) -> dict[str, jax.Array]:
        """One batch (K=1), or the next K stacked on a new leading axis; the iterator advances
        by exactly K batches, so its state matches the step."""
        if self.k == 1:
            return sharding.shard_batch(next(iterator), self._mesh, self._rules)
        batches = [next(iterator) for _ in range(self.k)]
        stacked = {name: np.stack([b[name] for b in batches]) for name in batches[0]}
        placed = NamedSharding(self._mesh, P(None, sharding.batch_axes(self._rules)))
        if jax.process_count() == 1:
            return jax.device_put(stacked, placed)
        return {
            name: jax.make_array_from_process_local_data(placed, value)
            for name, value in stacked.items()
        }


def _scanned(train_step: Callable) -> Callable:
    @functools.partial(jax.jit, donate_argnums=0)
    def scan_steps(state, sums, batches, key):
        def body(carry, batch):
            return train_step(*carry, batch, key), None

        (state, sums), _ = jax.lax.scan(body, (state, sums), batches)
        return state, sums

    return scan_steps

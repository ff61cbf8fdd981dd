"""Orbax checkpoints of everything a run's future depends on, one directory per saved step.

A checkpoint holds the model and optimizer state (params, BatchNorm statistics, module-bound
RngState, optimizer moments and step), the Grain iterator's position, and the resolved config
as JSON (never pickled). Saves are asynchronous: the blocking part copies device arrays to host,
the write to disk overlaps with training, and `close()` waits for it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp


class Checkpointer:
    def __init__(self, directory: str | os.PathLike):
        self.directory = os.path.abspath(directory)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=True),
        )

    def save(
        self,
        step: int,
        state: Any,
        data_iterator: grain.DatasetIterator,
        config: Mapping[str, Any],
    ) -> None:
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=grain.checkpoint.CheckpointSave(data_iterator),
                config=ocp.args.JsonSave(dict(config)),
            ),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def restore_state(self, step: int, abstract_state: Any) -> Any:
        """The state saved at `step`, placed with the shardings that `abstract_state` carries."""
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)),
        )
        return restored["state"]

    def restore_config(self, step: int) -> dict[str, Any]:
        restored = self._manager.restore(
            step, args=ocp.args.Composite(config=ocp.args.JsonRestore())
        )
        return restored["config"]

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def abstract_like(state: Any) -> Any:
    """Shape, dtype and sharding of every leaf: a restore target that allocates nothing."""
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state
    )

"""Orbax checkpoints of everything a run's future depends on, one directory per saved step.

A checkpoint `<workdir>/checkpoints/<step>/` holds five items:
- `state`: the model and optimizer state (params, BatchNorm statistics, module-bound RngState,
  optimizer moments and update count), as one `nnx.State`;
- `window`: the training metrics summed so far in the current, not yet logged, log window, so a
  resumed run logs exactly the numbers an uninterrupted one would;
- `data`: the Grain iterator's position;
- `meta` (JSON): the step, the base PRNG key, where the log window started, the last eval;
- `config` (JSON): the resolved config. Nothing is ever pickled or eval'ed.

Saves are asynchronous: the blocking part copies device arrays to host, the write to disk
overlaps with training, and `close()` waits for it. Orbax writes into `<step>.orbax-checkpoint-
tmp-*` and renames it when complete, so a save killed midway never looks like a checkpoint; the
leftover is deleted when the next run opens the directory.

Retention: the latest `keep` checkpoints, plus (with `best_metric`) the best one by that eval
metric among the checkpoints saved with an eval. The latest is never deleted (DESIGN.md §8).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers as policies

FORMAT = 1
"""Version of the checkpoint layout above; a checkpoint with another version is refused."""

UNREADABLE_SUFFIX = ".unreadable"
"""A checkpoint that cannot be read is renamed `<step>.unreadable` (kept, never deleted), so the
run that falls back to an earlier step can write that step again."""


class Checkpointer:
    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
    ):
        self.directory = os.path.abspath(directory)
        preserve: list[Any] = [policies.LatestN(n=keep)]  # None: keep all
        if best_metric:
            worst = math.inf if best_mode == "min" else -math.inf

            def metric(metrics: Mapping[str, Any]) -> float:
                value = float(metrics.get(best_metric, worst))
                return worst if math.isnan(value) else value

            preserve.append(
                policies.BestN(
                    get_metric_fn=metric,
                    reverse=best_mode == "min",  # sorted best-last: descending for a loss
                    n=1,
                    keep_checkpoints_without_metrics=False,
                )
            )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                create=True,
                enable_async_checkpointing=True,
                cleanup_tmp_directories=True,
                preservation_policy=policies.AnyPreservationPolicy(preserve),
            ),
        )

    def save(
        self,
        step: int,
        state: Any,
        data_iterator: grain.DatasetIterator,
        config: Mapping[str, Any],
        *,
        window: Any = None,
        meta: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> None:
        """Start saving `step`; returns once the arrays are copied off the device.

        `metrics` (an eval's) rank the checkpoint for `best_metric`; without them it is kept
        only while it is among the latest `keep`."""
        items: dict[str, Any] = {
            "state": ocp.args.StandardSave(state),
            "data": grain.checkpoint.CheckpointSave(data_iterator),
            "config": ocp.args.JsonSave(dict(config)),
            "meta": ocp.args.JsonSave({"format": FORMAT, "step": step, **dict(meta or {})}),
        }
        if window is not None:
            items["window"] = ocp.args.StandardSave(window)
        self._manager.save(
            step,
            args=ocp.args.Composite(**items),
            metrics=dict(metrics) if metrics else None,
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def step_path(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def restore(
        self,
        step: int,
        abstract_state: Any,
        data_iterator: grain.DatasetIterator | None = None,
        abstract_window: Any = None,
    ) -> dict[str, Any]:
        """Everything saved at `step`: `state` (and `window`) placed with the shardings their
        abstract targets carry, `meta`, `config`, and the iterator set to the saved position."""
        items: dict[str, Any] = {
            "state": ocp.args.StandardRestore(abstract_state),
            "meta": ocp.args.JsonRestore(),
            "config": ocp.args.JsonRestore(),
        }
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
        if abstract_window is not None:
            items["window"] = ocp.args.StandardRestore(abstract_window)
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        return {name: restored[name] for name in items}

    def restore_state(self, step: int, abstract_state: Any) -> Any:
        """The state saved at `step`, placed with the shardings that `abstract_state` carries."""
        return self.restore(step, abstract_state)["state"]

    def restore_config(self, step: int) -> dict[str, Any]:
        restored = self._manager.restore(
            step, args=ocp.args.Composite(config=ocp.args.JsonRestore())
        )
        return restored["config"]

    def set_aside(self, step: int) -> str:
        """Rename an unreadable checkpoint to `<step>.unreadable` (kept for inspection) so that
        the step can be saved again; returns the new path."""
        target = self.step_path(step) + UNREADABLE_SUFFIX
        n = 1
        while os.path.exists(target):
            n += 1
            target = f"{self.step_path(step)}{UNREADABLE_SUFFIX}.{n}"
        os.rename(self.step_path(step), target)
        self._manager.reload()
        return target

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def saved_steps(directory: str | os.PathLike) -> list[int]:
    """The complete checkpoints in `directory`, by their step (no Orbax manager: reading only)."""
    if not os.path.isdir(directory):
        return []
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def read_json(step_path: str | os.PathLike, item: str) -> dict[str, Any]:
    """A JSON item (`config`, `meta`) of the checkpoint at `step_path`."""
    with open(os.path.join(step_path, item, "metadata")) as f:
        return json.load(f)


SavedPath = tuple[str, ...]
"""A leaf of the saved `state` item: its path, e.g. ('0', 'head', 'kernel') for the model's
head kernel ('0': the model, '1': the optimizer)."""


def saved_shapes(step_path: str | os.PathLike) -> dict[SavedPath, tuple[int, ...]]:
    """The shape of every array in the checkpoint's `state`, read from its metadata only."""
    handler = ocp.PyTreeCheckpointHandler()
    try:
        metadata = handler.metadata(epath.Path(step_path) / "state")
    finally:
        handler.close()
    shapes = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(metadata.tree)[0]:
        parts = tuple(str(getattr(key, "key", key)) for key in path)
        shapes[parts[:-1] if parts[-1] == "value" else parts] = tuple(leaf.shape)
    return shapes


def restore_arrays(
    step_path: str | os.PathLike, targets: Mapping[SavedPath, jax.ShapeDtypeStruct]
) -> dict[SavedPath, jax.Array]:
    """Only the arrays `targets` names from the checkpoint's `state`, each placed with its
    target's sharding (so a checkpoint written on one mesh loads onto another)."""
    tree: dict[str, Any] = {}
    for path, target in targets.items():
        node = tree
        for part in path:
            node = node.setdefault(part, {})
        node["value"] = target
    handler = ocp.PyTreeCheckpointHandler()
    try:
        restored = handler.restore(
            epath.Path(step_path) / "state",
            args=ocp.args.PyTreeRestore(
                item=tree,
                restore_args=ocp.checkpoint_utils.construct_restore_args(tree),
                partial_restore=True,
            ),
        )
    finally:
        handler.close()
    arrays = {}
    for path in targets:
        node = restored
        for part in path:
            node = node[part]
        arrays[path] = node["value"]
    return arrays


def abstract_like(state: Any) -> Any:
    """Shape, dtype and sharding of every leaf: a restore target that allocates nothing."""
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state
    )

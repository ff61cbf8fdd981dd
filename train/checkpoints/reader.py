"""Reading a run's saved checkpoints without a checkpoint manager: which steps are complete,
their JSON items, the shapes of their arrays, and some of those arrays, each placed with the
sharding of its target (a checkpoint written on one mesh loads onto another), verified against
the checksums saved with it. Loading a model (`zoo.load`) and starting a fine-tune from another
run read this way, never writing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from zoo.engine.checkpoints import checksums
from zoo.engine.errors import CorruptCheckpoint


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
    return {path: tuple(leaf.shape) for path, leaf in _saved_leaves(step_path).items()}


def _saved_leaves(step_path: str | os.PathLike) -> dict[SavedPath, Any]:
    """The metadata (shape, dtype) of every array in the checkpoint's `state`."""
    import orbax.checkpoint as ocp
    from etils import epath

    handler = ocp.PyTreeCheckpointHandler()
    try:
        metadata = handler.metadata(epath.Path(step_path) / "state")
    finally:
        handler.close()
    leaves = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(metadata.tree)[0]:
        parts = tuple(str(getattr(key, "key", key)) for key in path)
        leaves[parts[:-1] if parts[-1] == "value" else parts] = leaf
    return leaves


def restore_arrays(
    step_path: str | os.PathLike, targets: Mapping[SavedPath, jax.ShapeDtypeStruct]
) -> dict[SavedPath, jax.Array]:
    """Only the arrays `targets` names from the checkpoint's `state`, each placed with its
    target's sharding (so a checkpoint written on one mesh loads onto another) and cast to its
    target's dtype (a float32 run fine-tuned with `model.param_dtype=bf16`) once it is checked
    against its checksum, which was taken of the array as it was saved."""
    saved = _saved_leaves(step_path)
    as_saved = {
        path: jax.ShapeDtypeStruct(
            target.shape, _saved_float(saved.get(path), target.dtype), sharding=target.sharding
        )
        for path, target in targets.items()
    }
    arrays = _restored(step_path, as_saved)
    verify(step_path, {"/".join(("state", *path)): array for path, array in arrays.items()})
    return {
        path: array if array.dtype == targets[path].dtype else array.astype(targets[path].dtype)
        for path, array in arrays.items()
    }


def _saved_float(leaf: Any, dtype: Any) -> Any:
    """The dtype a float array was saved in, to read it in; `dtype` for anything else (a
    random key, saved as its integers)."""
    stored = getattr(leaf, "dtype", None)
    floats = stored is not None and jnp.issubdtype(stored, jnp.floating)
    return stored if floats and jnp.issubdtype(dtype, jnp.floating) else dtype


def _restored(
    step_path: str | os.PathLike, targets: Mapping[SavedPath, jax.ShapeDtypeStruct]
) -> dict[SavedPath, jax.Array]:
    import orbax.checkpoint as ocp
    from etils import epath

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


def verify(step_path: str | os.PathLike, arrays: Mapping[str, jax.Array]) -> None:
    """Compare restored arrays (named as in `zoo.engine.checkpoints.checksums.flat`) with the checksums saved
    with them; checkpoints written before checksums existed have none to compare."""
    expected = read_json(step_path, "meta").get("checksums", {})
    damaged = checksums.mismatches(expected, arrays)
    if damaged:
        listed = ", ".join(damaged[:3]) + (
            f" and {len(damaged) - 3} more" if len(damaged) > 3 else ""
        )
        raise CorruptCheckpoint(
            f"the data of {listed} read back from {step_path} differs from what was saved "
            "(checksum mismatch): the files were damaged after the save"
        )


def abstract_like(state: Any) -> Any:
    """Shape, dtype and sharding of every leaf: a restore target that allocates nothing."""
    return jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state
    )

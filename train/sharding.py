"""The device mesh and the logical-axis rules that place params and batches on it.

Models annotate params with logical axis names (`nnx.with_partitioning(init, ("embed", "mlp"))`);
the rules below map those names to mesh axes, so the same model runs data-parallel, fully
sharded or tensor-parallel by changing the mesh alone. Every axis is `AxisType.Explicit`: the
sharding of each array is part of its type and checked at trace time.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zoo.errors import ZooError

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", BATCH_AXES),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("vocab", "tensor"),
    ("conv_in", None),
    ("conv_out", "tensor"),
)


def make_mesh(mesh_config: Any) -> Mesh:
    """A mesh with axes (data, fsdp, tensor) over the first data*fsdp*tensor devices."""
    shape = tuple(int(getattr(mesh_config, axis)) for axis in MESH_AXES)
    devices = jax.devices()
    if any(size < 1 for size in shape) or math.prod(shape) > len(devices):
        raise ZooError(
            f"Cannot build a mesh of data={shape[0]}, fsdp={shape[1]}, tensor={shape[2]}: each "
            f"size must be >= 1 and their product at most the {len(devices)} available device(s)."
        )
    return jax.make_mesh(
        shape,
        MESH_AXES,
        axis_types=(AxisType.Explicit,) * len(MESH_AXES),
        devices=devices[: math.prod(shape)],
    )


@contextlib.contextmanager
def activate(mesh: Mesh, rules: tuple[tuple[str, Any], ...] = DEFAULT_RULES) -> Iterator[None]:
    """Make `mesh` current (explicit-sharding mode) with the logical-axis rules in force."""
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        yield


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES))


def batch_divisor(mesh: Mesh) -> int:
    return math.prod(mesh.shape[axis] for axis in BATCH_AXES)


def shard_batch(batch: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """Place a host batch on the mesh, split along the batch axes; each process passes its own
    share (the whole batch when there is one process)."""
    sharding = batch_sharding(mesh)
    if jax.process_count() == 1:
        return jax.device_put(dict(batch), sharding)  # one call for all columns: far cheaper
    return {
        name: jax.make_array_from_process_local_data(sharding, value)
        for name, value in batch.items()
    }

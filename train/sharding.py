"""The device mesh, the logical-axis rules, and the sharding plan they give every param.

Models annotate params with logical axis names (`nnx.with_partitioning(init, ("embed", "mlp"))`)
and activations with `logical_spec("batch", None)`; the rules map those names to the mesh axes
`data`, `fsdp` and `tensor`, so one model runs data-parallel, fully sharded, tensor-parallel or
any mix by changing the mesh and the rules alone. Every axis is `AxisType.Explicit`: each
array's sharding is part of its type and checked at trace time.

The rules are strict: a logical name without a rule, a dimension the mesh cannot divide, or one
mesh axis used twice in one array is an error naming the param, the dimension and the axes,
never a silent fall-back to replication.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from zoo.engine.errors import ZooError

MESH_AXES = ("data", "fsdp", "tensor")

DEFAULT_RULES: dict[str, Any] = {
    "batch": ["data", "fsdp"],
    "embed": "fsdp",
    "mlp": "tensor",
    "heads": "tensor",
    "vocab": "tensor",
    "conv_in": None,
    "conv_out": "tensor",
}
"""Logical axis -> mesh axes: one axis, a list of axes, or None (replicated)."""


@dataclasses.dataclass(frozen=True)
class AxisRules:
    """Validated logical-axis rules: each logical name maps to a tuple of mesh axes."""

    table: Mapping[str, tuple[str, ...]]

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> AxisRules:
        table: dict[str, tuple[str, ...]] = {}
        for name, target in mapping.items():
            axes = () if target is None else (target,) if isinstance(target, str) else tuple(target)
            unknown = [axis for axis in axes if axis not in MESH_AXES]
            if unknown or len(set(axes)) != len(axes):
                raise ZooError(
                    f"Sharding rule mesh.rules.{name}={list(axes)} is invalid: each target must "
                    f"be one of the mesh axes {list(MESH_AXES)}, at most once (or null)."
                )
            table[str(name)] = axes
        return cls(table)

    def mesh_axes(self, name: str, what: str) -> tuple[str, ...]:
        if name not in self.table:
            raise ZooError(
                f"{what} uses the logical axis '{name}', which no sharding rule maps. "
                f"Known logical axes: {', '.join(sorted(self.table))}; add one with "
                f"'+mesh.rules.{name}=<mesh axis or null>'."
            )
        return self.table[name]

    def spec(self, logical: Sequence[str | None], shape: Sequence[int], mesh: Mesh, what: str) -> P:
        """The PartitionSpec for an array of `shape` annotated with `logical` names."""
        entries: list[Any] = []
        used: dict[str, int] = {}
        for dim, (name, size) in enumerate(zip(logical, shape, strict=True)):
            axes = () if name is None else self.mesh_axes(name, f"{what} on dimension {dim}")
            for axis in axes:
                if axis in used:
                    raise ZooError(
                        f"{what} would use mesh axis '{axis}' twice: on dimension {used[axis]} "
                        f"and on dimension {dim} ('{name}'). Change mesh.rules so that its "
                        f"logical axes {tuple(logical)} map to distinct mesh axes."
                    )
                used[axis] = dim
            ways = math.prod(mesh.shape[axis] for axis in axes)
            if size % ways:
                raise ZooError(
                    f"{what} has dimension {dim} of size {size} ('{name}'), which mesh axes "
                    f"{list(axes)} cannot split {ways} ways. Use mesh sizes whose product along "
                    f"{list(axes)} divides {size}, or map '{name}' elsewhere in mesh.rules."
                )
            entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return P(*entries)

    def as_flax_rules(self) -> tuple[tuple[str, Any], ...]:
        return tuple((name, axes or None) for name, axes in self.table.items())


_ACTIVE_RULES: contextvars.ContextVar[AxisRules | None] = contextvars.ContextVar(
    "zoo_axis_rules", default=None
)


def check_mesh_sizes(sizes: Mapping[str, int]) -> list[int]:
    """The (data, fsdp, tensor) sizes: positive, or -1 for at most one of them."""
    shape = [int(sizes[axis]) for axis in MESH_AXES]
    if shape.count(-1) > 1 or any(size == 0 or size < -1 for size in shape):
        given = ", ".join(
            f"mesh.{axis}={size}" for axis, size in zip(MESH_AXES, shape, strict=True)
        )
        raise ZooError(
            f"Invalid mesh ({given}): sizes are positive, and at most one may be -1 "
            "(all the remaining devices)."
        )
    return shape


def resolve_mesh_shape(sizes: Mapping[str, int], device_count: int) -> tuple[int, ...]:
    """Sizes for (data, fsdp, tensor); one of them may be -1: all the remaining devices."""
    shape = check_mesh_sizes(sizes)
    given = ", ".join(f"{axis}={size}" for axis, size in zip(MESH_AXES, shape, strict=True))
    known = math.prod(size for size in shape if size != -1)
    if -1 in shape:
        if device_count % known:
            raise ZooError(
                f"Cannot fill the mesh ({given}) from {device_count} devices: the fixed sizes "
                f"multiply to {known}, which does not divide {device_count}."
            )
        shape[shape.index(-1)] = device_count // known
    elif known != device_count:
        raise ZooError(
            f"The mesh ({given}) needs {known} devices but {device_count} are available. Choose "
            f"sizes whose product is {device_count}, e.g. mesh.data={device_count}, or set one "
            "size to -1 to use all the remaining devices."
        )
    return tuple(shape)


def make_mesh(sizes: Mapping[str, int], devices: Sequence[Any] | None = None) -> Mesh:
    """A mesh with Explicit axes (data, fsdp, tensor) over `devices` (default: all)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(sizes, len(devices))
    return jax.make_mesh(
        shape, MESH_AXES, axis_types=(AxisType.Explicit,) * len(MESH_AXES), devices=devices
    )


def mesh_and_rules(
    mesh_config: Mapping[str, Any], devices: Sequence[Any] | None = None
) -> tuple[Mesh, AxisRules]:
    """The mesh and the validated rules that a `mesh` config section describes."""
    return make_mesh(mesh_config, devices), AxisRules.from_mapping(mesh_config["rules"])


@contextlib.contextmanager
def activate(mesh: Mesh, rules: AxisRules) -> Iterator[None]:
    """Make `mesh` current (explicit-sharding mode) with `rules` in force for params (through
    Flax's logical-axis rules) and for activations (through `logical_spec`)."""
    token = _ACTIVE_RULES.set(rules)
    try:
        with jax.set_mesh(mesh), nnx.logical_axis_rules(rules.as_flax_rules()):
            yield
    finally:
        _ACTIVE_RULES.reset(token)


NO_MESH = (
    "No sharding rules are active, and the model's explicitly sharded layers need its mesh: "
    "call a model that zoo.load, zoo.fit or zoo.finetune returned inside `with "
    "trained.activate(): trained.model(x)` (or use zoo.predict); a model of your own under "
    "zoo.engine.sharding.activate(mesh, rules)."
)


def active_rules() -> AxisRules:
    """The rules in force (see `activate`)."""
    rules = _ACTIVE_RULES.get()
    if rules is None:
        raise ZooError(NO_MESH)
    return rules


@contextlib.contextmanager
def unsplit_batch() -> Iterator[None]:
    """The active rules with `batch` unsplit, on the mesh already active: for calls on a few
    examples (a prompt of one, a grid of images) that the batch axes cannot divide."""
    rules = active_rules()
    token = _ACTIVE_RULES.set(dataclasses.replace(rules, table={**rules.table, "batch": ()}))
    try:
        yield
    finally:
        _ACTIVE_RULES.reset(token)


def logical_spec(*names: str | None) -> P:
    """The PartitionSpec of an activation with these logical axes, under the active rules;
    e.g. `layer(h, out_sharding=logical_spec("batch", None))`."""
    rules = _ACTIVE_RULES.get()
    if rules is None:
        raise ZooError(NO_MESH)
    entries = []
    for name in names:
        axes = () if name is None else rules.mesh_axes(name, "An activation")
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*entries)


def batch_axes(rules: AxisRules) -> tuple[str, ...]:
    return rules.mesh_axes("batch", "The input batch")


def batch_divisor(mesh: Mesh, rules: AxisRules) -> int:
    return math.prod(mesh.shape[axis] for axis in batch_axes(rules))


def shard_batch(
    batch: Mapping[str, np.ndarray], mesh: Mesh, rules: AxisRules, stacked: bool = False
) -> dict[str, jax.Array]:
    """Place a host batch on the mesh, split along the batch axes; each process passes its own
    share (the whole batch when there is one process). `stacked`: the columns hold several
    batches on a leading axis, which stays whole."""
    sharding = NamedSharding(mesh, P(*[None] * stacked, batch_axes(rules)))
    if jax.process_count() == 1:
        return jax.device_put(dict(batch), sharding)  # one call for all columns: far cheaper
    return {
        name: jax.make_array_from_process_local_data(sharding, value)
        for name, value in batch.items()
    }


def variable_sharding(variable: Any, path: str, mesh: Mesh | None, rules: Any) -> NamedSharding:
    """The sharding of the array that replaces `variable`'s: its own, or (an abstract variable,
    from `nnx.eval_shape`) that of its logical axes under `rules` on `mesh`."""
    current = variable.get_value()
    if isinstance(current, jax.Array):
        return current.sharding
    logical = variable.get_metadata().get("out_sharding")
    spec = () if logical is None else rules.spec(logical, tuple(variable.shape), mesh, f"'{path}'")
    return NamedSharding(mesh, P(*spec))

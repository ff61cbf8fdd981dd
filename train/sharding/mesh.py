"""The device mesh, the logical-axis rules, and the sharding plan they give every param.

Models annotate params with logical axis names (`nnx.with_partitioning(init, ("embed", "mlp"))`)
and activations with `logical_spec("batch", None)`; the rules map those names to the mesh axes
`data`, `fsdp`, `expert` and `tensor`, so one model runs data-parallel, fully sharded,
expert-parallel, tensor-parallel or any mix by changing the mesh and the rules alone. Every
axis is `AxisType.Explicit`: each array's sharding is part of its type and checked at trace
time. `expert` splits a mixture of experts' experts and, through the `batch` rule, the batch
(`zoo.models.experts` exchanges each mixture layer's tokens between its devices).

The rules are strict: a logical name without a rule, a dimension the mesh cannot divide, or one
mesh axis used twice in one array is an error naming the param, the dimension and the axes.
Two exceptions leave an array whole on an axis instead, and the plan says so in a line of its
own, so that nothing falls back silently:
- `fsdp` only decides where params are stored, never how the computation splits, so a dimension
  it cannot divide is stored whole on it (the run works as it would without it), and the params
  it leaves whole are listed.
- `kv_heads` (the key/value heads of grouped-query attention) are fewer than the query heads by
  design: two KV heads cannot split four tensor ways, and each tensor device then computes with
  all of them (they are few) rather than refusing the mesh.

A dimension may name several logical axes, `(("mlp", "embed"), None)`: it is split on all of
their mesh axes. That is how a kernel whose input features are sharded on `tensor` (a classifier
head after a column-parallel layer) is split by FSDP too: under `fsdp=N` each device then holds
1/N of every kernel and embedding with a dimension named for `fsdp` that N divides. The plan
lists the params of two or more dimensions that FSDP leaves whole. 1-D params (biases, norm
scales) stay whole: they meet batch-sharded activations, which already use `fsdp`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import flax
import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from zoo.engine.errors import ZooError

MESH_AXES = ("data", "fsdp", "expert", "tensor")

DEFAULT_RULES: dict[str, Any] = {
    "batch": ["data", "fsdp", "expert"],
    "embed": "fsdp",
    "mlp": "tensor",
    "expert": "expert",
    "heads": "tensor",
    "kv_heads": "tensor",
    "vocab": "tensor",
    "conv_in": "fsdp",
    "conv_out": "tensor",
}
"""Logical axis -> mesh axes: one axis, a list of axes, or None (replicated)."""

Logical = str | tuple[str, ...] | None
"""A dimension's logical name: one name, several (split on all of their mesh axes), or None."""

FSDP = "fsdp"
EXPERT = "expert"
WHOLE_WHERE_INDIVISIBLE = frozenset({"kv_heads"})
"""Logical axes that stay whole on mesh axes that cannot divide them (see the module
docstring)."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where an array lives (`spec`), and why it is whole on an axis its annotations name or
    that FSDP would use (`notes`: one line each, without the array's name, so that alike params
    share them)."""

    spec: P
    notes: tuple[str, ...] = ()


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

    def spec(self, logical: Sequence[Logical], shape: Sequence[int], mesh: Mesh, what: str) -> P:
        """The PartitionSpec for an array of `shape` annotated with `logical` names."""
        return self.placement(logical, shape, mesh, what).spec

    def placement(
        self, logical: Sequence[Logical], shape: Sequence[int], mesh: Mesh, what: str
    ) -> Placement:
        """Where an array of `shape` annotated with `logical` names lives on `mesh`, and why it
        is whole on an axis where it is (see the module docstring)."""
        dims = [self._dim_axes(logical, shape, mesh, what, dim) for dim in range(len(shape))]
        notes = [note for _, note in dims if note]
        fsdp = mesh.shape.get(FSDP, 1)
        if len(shape) >= 2 and fsdp > 1 and all(FSDP not in axes for axes, _ in dims):
            named = any(FSDP in self.axes_of(name) for name in logical)
            notes.append(
                f"whole on every device: fsdp={fsdp} cannot divide the dimension named for it"
                if named
                else "whole on every device: no dimension named for fsdp"
            )
        return Placement(P(*(_entry(axes) for axes, _ in dims)), tuple(notes))

    def axes_of(self, name: Logical) -> tuple[str, ...]:
        """The mesh axes of a dimension's logical name (several names: all of their axes)."""
        return tuple(axis for each in _names(name) for axis in self.table.get(each, ()))

    def _dim_axes(
        self, logical: Sequence[Logical], shape: Sequence[int], mesh: Mesh, what: str, dim: int
    ) -> tuple[tuple[str, ...], str]:
        """The mesh axes of one dimension, checked, and a note where it stays whole on some."""
        name, size = logical[dim], shape[dim]
        for each in _names(name):
            self.mesh_axes(each, f"{what} on dimension {dim}")
        axes = self.axes_of(name)
        for i, axis in enumerate(axes):
            earlier = [d for d in range(dim) if axis in self.axes_of(logical[d])]
            if earlier or axis in axes[:i]:
                raise ZooError(
                    f"{what} would use mesh axis '{axis}' twice: on dimension "
                    f"{earlier[0] if earlier else dim} and on dimension {dim} ('{name}'). Change "
                    f"mesh.rules so that its logical axes {tuple(logical)} map to distinct mesh "
                    "axes."
                )
        ways = _ways(axes, mesh)
        if size % ways == 0:
            return axes, ""
        if name in WHOLE_WHERE_INDIVISIBLE:
            return (), f"{name} of size {size} replicated on {_named(axes, mesh)} ({ways} ways)"
        if FSDP in axes and size % (ways // mesh.shape[FSDP]) == 0:
            return tuple(a for a in axes if a != FSDP), ""  # said once for the array
        raise ZooError(
            f"{what} has dimension {dim} of size {size} ('{name}'), which mesh axes "
            f"{list(axes)} cannot split {ways} ways. Use mesh sizes whose product along "
            f"{list(axes)} divides {size}, or map '{name}' elsewhere in mesh.rules."
        )


def _names(name: Logical) -> tuple[str, ...]:
    return () if name is None else (name,) if isinstance(name, str) else tuple(name)


def _ways(axes: Sequence[str], mesh: Mesh) -> int:
    return math.prod(mesh.shape[axis] for axis in axes)


def _named(axes: Sequence[str], mesh: Mesh) -> str:
    return "x".join(f"{axis}={mesh.shape[axis]}" for axis in axes)


def _entry(axes: Sequence[str]) -> Any:
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


_ACTIVE_RULES: contextvars.ContextVar[AxisRules | None] = contextvars.ContextVar(
    "zoo_axis_rules", default=None
)


def check_mesh_sizes(sizes: Mapping[str, int]) -> list[int]:
    """The sizes of `MESH_AXES` (1 for an axis `sizes` leaves out): positive, or -1 for at most
    one of them."""
    shape = [int(sizes.get(axis, 1)) for axis in MESH_AXES]
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
    """Sizes for `MESH_AXES`; one of them may be -1: all the remaining devices."""
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
    """A mesh with Explicit axes `MESH_AXES` over `devices` (default: all)."""
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
    """Make `mesh` current (explicit-sharding mode) with `rules` in force for activations
    (through `logical_spec`) and for the params that `zoo.engine.sharding.plan.create_sharded` places.
    Flax does not place params created here by renaming their logical axes (eager sharding is
    off): it knows neither a dimension named for several axes nor the ones an axis may leave
    whole, so the plan alone decides (see `AxisRules.placement`)."""
    token = _ACTIVE_RULES.set(rules)
    try:
        with jax.set_mesh(mesh), nnx.use_eager_sharding(False):
            yield
    finally:
        _ACTIVE_RULES.reset(token)


_NO_MESH = Mesh(np.empty((), dtype=object), ())
"""The mesh of no devices: what `jax.set_mesh` makes current to leave no mesh current."""


@contextlib.contextmanager
def deactivated() -> Iterator[None]:
    """Inside `activate`: no mesh current, no rules in force and Flax's own default for eager
    sharding, as outside it. For the caller's code that the training loop runs with its mesh
    current (a callback's hook), so that what it builds or loads (`zoo.load` of a checkpoint
    onto one device) is placed on a mesh of its own, as it would be after the run."""
    token = _ACTIVE_RULES.set(None)
    try:
        with jax.set_mesh(_NO_MESH), nnx.use_eager_sharding(flax.config.flax_always_shard_variable):
            yield
    finally:
        _ACTIVE_RULES.reset(token)


NO_MESH = (
    "No sharding rules are active, and the model's explicitly sharded layers need its mesh: "
    "call a model that zoo.load, zoo.fit or zoo.finetune returned inside `with "
    "trained.activate(): trained.model(x)` (or use zoo.predict); a model of your own under "
    "zoo.engine.sharding.mesh.activate(mesh, rules)."
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

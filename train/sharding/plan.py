"""The sharding plan: where every array of the train state lives, decided before it exists.

The plan is computed from an abstract (shape-only) state, so bad rules fail before a single
array is allocated; the model is then created inside `jax.jit` under the mesh, each param born
with its planned sharding, so no device ever holds a full unsharded copy. Where the rules leave
a param whole on an axis rather than refuse the mesh (see `zoo.engine.sharding.mesh`), the plan says
so, one line per reason.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from zoo.engine.errors import ZooError
from zoo.engine.sharding.abstract import eval_shape
from zoo.engine.sharding.mesh import EXPERT, AxisRules, Placement


@dataclasses.dataclass(frozen=True)
class PlanRow:
    path: str
    group: str  # "params", "optimizer" or "other" (BatchNorm statistics, RNG streams, ...)
    logical: tuple[str | None, ...] | None  # None: not annotated, replicated
    spec: P
    shape: tuple[int, ...]
    bytes_total: int
    bytes_per_device: int
    notes: tuple[str, ...] = ()  # why it is whole on an axis, see `AxisRules.placement`


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    mesh_shape: dict[str, int]
    rows: list[PlanRow]

    def row(self, path: str) -> PlanRow:
        return next(row for row in self.rows if row.path == path)

    def totals(self, group: str) -> tuple[int, int]:
        """(bytes per device, bytes in all) of one group of the state."""
        rows = [row for row in self.rows if row.group == group]
        return sum(r.bytes_per_device for r in rows), sum(r.bytes_total for r in rows)

    def table(self) -> str:
        mesh = " ".join(f"{axis}={size}" for axis, size in self.mesh_shape.items())
        params = [row for row in self.rows if row.group == "params"]
        header = ("param", "logical axes", "spec", "shape", "bytes/device")
        lines = [header] + [
            (
                row.path,
                "-" if row.logical is None else str(tuple(row.logical)),
                str(row.spec),
                str(row.shape),
                f"{row.bytes_per_device:,}",
            )
            for row in params
        ]
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        text = [f"Sharding plan on mesh {mesh} ({math.prod(self.mesh_shape.values())} devices):"]
        text += ["  " + "  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in lines]
        for group in ("params", "optimizer", "other"):
            per_device, total = self.totals(group)
            text.append(
                f"  {group}: {readable_size(per_device)} per device of {readable_size(total)} in all"
            )
        return "\n".join(text + [f"  {line}" for line in self.notes()])

    def notes(self) -> list[str]:
        """One line per reason that params stay whole on a mesh axis (see
        `zoo.engine.sharding.mesh.AxisRules.placement`), naming the params it holds for."""
        held: dict[str, list[str]] = {}
        for row in self.rows:
            if row.group == "params":
                for note in row.notes:
                    held.setdefault(note, []).append(row.path)
        return [f"{note}: {_listed(paths)}" for note, paths in held.items()]


def plan_state(state: nnx.State, mesh: Mesh, rules: AxisRules) -> ShardingPlan:
    """The plan for an (abstract) state of `(model, optimizer)`, validating every annotation."""
    rows = []
    for path, variable in nnx.to_flat_state(state):
        name = ".".join(str(part) for part in path[1:])
        group = (
            "optimizer"
            if path[0] == 1
            else "params"
            if isinstance(variable, nnx.Param)
            else "other"
        )
        logical = variable.get_metadata().get("out_sharding")
        shape = tuple(variable.shape)
        what = f"'{name}' (shape {shape})"
        placement = (
            Placement(P()) if logical is None else rules.placement(logical, shape, mesh, what)
        )
        spec = placement.spec
        itemsize = variable.dtype.itemsize  # also right for typed PRNG keys
        total = math.prod(shape) * itemsize
        ways = math.prod(
            math.prod(mesh.shape[a] for a in ((e,) if isinstance(e, str) else e))
            for e in spec
            if e is not None
        )
        rows.append(
            PlanRow(name, group, logical, spec, shape, total, total // ways, placement.notes)
        )
    check_experts_split(state, mesh, rules)
    return ShardingPlan(dict(mesh.shape), rows)


def check_experts_split(state: nnx.State, mesh: Mesh, rules: AxisRules) -> None:
    """Refuse an `expert` axis of more than one device on a model whose params it splits none
    of: it is there to split a mixture of experts' experts, and on a model without them it
    would only split the batch, as `data` does, while the run claims expert parallelism."""
    ways = mesh.shape.get(EXPERT, 1)
    if ways == 1:
        return
    for _, variable in nnx.to_flat_state(state):
        logical = variable.get_metadata().get("out_sharding") or ()
        if isinstance(variable, nnx.Param) and any(EXPERT in rules.axes_of(n) for n in logical):
            return
    raise ZooError(
        f"mesh.expert={ways} splits the experts of a mixture of experts, and this model has none "
        "(no param has a dimension that mesh.rules map to 'expert'). Use mesh.expert=1 and "
        f"multiply another axis by {ways} (mesh.data splits the batch as the expert axis would), "
        "or a model with experts."
    )


def create_sharded(
    create: Callable[[], Any],
    mesh: Mesh,
    rules: AxisRules,
    prefill: Callable[[Any], None] | None = None,
) -> tuple[Any, ShardingPlan]:
    """Run `create()` (returning `(model, optimizer)`) so every array is born where the plan
    puts it; call under `zoo.engine.sharding.mesh.activate(mesh, rules)`. The plan, not Flax's
    renaming of logical axes, places them: only the plan knows the dimensions that a mesh axis
    cannot divide (see `zoo.engine.sharding.mesh.AxisRules.placement`).

    `prefill(abstract)`, given, sets arrays into some variables of the abstract result of
    `create()` (a fine-tune's weights, read from its checkpoint into their shardings): those
    arrays are taken as they are, handed over to the result without a copy, and the
    initialisation they replace is never computed, nor compiled. Every other array is the one
    `create()` makes, from the same random streams."""
    with nnx.use_eager_sharding(False):
        abstract = eval_shape(create)
        plan = plan_state(nnx.state(abstract), mesh, rules)
        specs = [row.spec for row in plan.rows]
        given = _prefilled(abstract, prefill)

        @functools.partial(nnx.jit, donate_argnums=0)
        def placed(given: dict[int, jax.Array]):
            created = create()
            flat = nnx.to_flat_state(nnx.state(created))
            for i, ((_, variable), spec) in enumerate(zip(flat, specs, strict=True)):
                value = given[i] if i in given else variable.get_value()
                variable.set_value(jax.sharding.reshard(value, spec))
            return created

        return placed(given), plan


def abstract_sharded(
    create: Callable[[], Any], mesh: Mesh, rules: AxisRules
) -> tuple[Any, ShardingPlan]:
    """What `create_sharded` makes, abstract: every array a `jax.ShapeDtypeStruct` with the
    sharding the plan gives it, nothing computed or allocated: the state of a run that restores
    every array of it from its checkpoint, straight into those shardings."""
    with nnx.use_eager_sharding(False):
        abstract = eval_shape(create)
        plan = plan_state(nnx.state(abstract), mesh, rules)
    flat = nnx.to_flat_state(nnx.state(abstract))
    for (_, variable), row in zip(flat, plan.rows, strict=True):
        value = variable.get_value()
        sharding = jax.sharding.NamedSharding(mesh, row.spec)
        variable.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding))
    return abstract, plan


def _prefilled(abstract: Any, prefill: Callable[[Any], None] | None) -> dict[int, jax.Array]:
    """The arrays `prefill` set into `abstract`, by the index of their variable in its flat
    state."""
    if prefill is None:
        return {}
    prefill(abstract)
    flat = nnx.to_flat_state(nnx.state(abstract))
    return {
        i: variable.get_value()
        for i, (_, variable) in enumerate(flat)
        if isinstance(variable.get_value(), jax.Array)
    }


def _listed(paths: list[str], shown: int = 3) -> str:
    more = len(paths) - shown
    return ", ".join(paths[:shown]) + (f" and {more} more" if more > 0 else "")


def readable_size(num_bytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:,.0f} {unit}" if unit == "B" else f"{num_bytes:,.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")

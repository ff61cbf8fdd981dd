"""Building a model on a device mesh: the one way the trainer, `zoo.load` and
`zoo.create_model` make a model, so each of them gets the same params, born sharded.

The model is the registered constructor's, with the LoRA adapters its run's `finetune` section
asks for; with an optax transformation it comes with its `nnx.Optimizer` (keeping float32 master
weights where it trains low-precision params, see `zoo.engine.weights.master`). Both are created inside
`jax.jit` under the mesh and the rules (`zoo.engine.sharding.plan.create_sharded`): no device ever holds a
full copy of a param that the plan shards.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import optax
from flax import nnx
from jax.sharding import Mesh
from zoo.engine.registry import ModelEntry
from zoo.engine.sharding import mesh as sharding
from zoo.engine.sharding.abstract import eval_shape
from zoo.engine.sharding.plan import ShardingPlan, abstract_sharded, create_sharded
from zoo.engine.steps import rngs
from zoo.engine.weights import master
from zoo.engine.weights.lora import add_adapters


def build_model(
    entry: ModelEntry, hparams: Mapping[str, Any], seed: int, finetune: Any = None
) -> nnx.Module:
    """The model a run's config describes: the registered model, with the LoRA adapters that
    `finetune` asks for (their base kernels quantized where it asks for QLoRA: a checkpoint's
    kernels as they fill it, or with no checkpoint to start from, or params of the model that
    start fresh, the random initialisation here). Call it under the mesh, so everything is
    born sharded."""
    model = entry.build(hparams, rngs.init_rngs(seed))
    if finetune is not None and finetune.lora_rank:
        add_adapters(
            model,
            finetune.lora_rank,
            finetune.lora_layers,
            rngs.adapter_rngs(seed),
            finetune.quantize,
            filled=finetune.init_from is not None and not finetune.reinit,
        )
    return model


def abstract_model(
    entry: ModelEntry, hparams: Mapping[str, Any], seed: int, finetune: Any = None
) -> nnx.Module:
    """The model `build_model` makes, abstract (each param a `jax.ShapeDtypeStruct` annotated
    with its logical axes, whose sharding on a mesh `zoo.engine.sharding.mesh.variable_sharding` gives):
    what a load fills, with nothing initialised only to be overwritten. Call it under the mesh,
    as `build_model`."""
    with nnx.use_eager_sharding(False):
        return eval_shape(lambda: build_model(entry, hparams, seed, finetune))


def check_buildable(entry: ModelEntry, hparams: Mapping[str, Any], finetune: Any = None) -> None:
    """Build the model abstractly (shapes only, no arrays, no mesh): a size its constructor
    refuses fails here, in a fraction of a second, before any data is loaded."""
    abstract_model(entry, hparams, 0, finetune)


@dataclasses.dataclass(frozen=True)
class Built:
    model: nnx.Module
    optimizer: nnx.Optimizer | None
    plan: ShardingPlan


def build_on_mesh(
    entry: ModelEntry,
    hparams: Mapping[str, Any],
    seed: int,
    mesh: Mesh,
    rules: sharding.AxisRules,
    *,
    finetune: Any = None,
    tx: optax.GradientTransformation | None = None,
    wrt: nnx.filterlib.Filter = nnx.Param,
    prefill: Callable[[nnx.Module], None] | None = None,
    abstract: bool = False,
) -> Built:
    """The model (and, given `tx`, its optimizer over the params `wrt` selects), every array
    born with the sharding its plan gives it on `mesh`; `prefill(model)`, given, fills some of
    the abstract model's params first (a fine-tune's starting weights), which are then never
    initialised (see `create_sharded`). `abstract`: nothing made, every array a
    `jax.ShapeDtypeStruct` with its planned sharding (a run about to restore them all, see
    `abstract_sharded`)."""

    def create():
        model = build_model(entry, hparams, seed, finetune)
        return (model,) if tx is None else (model, master.optimizer_for(model, tx, wrt))

    with sharding.activate(mesh, rules):
        if abstract:
            created, plan = abstract_sharded(create, mesh, rules)
        else:
            filled = None if prefill is None else lambda made: prefill(made[0])
            created, plan = create_sharded(create, mesh, rules, filled)
    return Built(created[0], created[1] if tx is not None else None, plan)

"""`trainer.precision=bf16`: mixed precision by casting at the loss function's door.

The params (and with them the optimizer state and the checkpoints) stay float32. Each call of
the loss casts the floating params and inputs to bfloat16, so every matmul and activation of
the forward pass, and therefore of the backward pass, runs in bfloat16, while the gradient
arrives float32 through the cast. What must stay accurate is float32 by construction: Flax's
norms compute their statistics in float32 whatever their input, the models take softmax and
losses of float32 logits, and the loss and metrics leave here as float32. Nothing else of the
run (optimizer, EMA, BatchNorm running statistics, RNG counts) ever sees a bfloat16 value.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from zoo.engine.config import Precision

COMPUTE = jnp.bfloat16


def compute_loss(loss_fn: Callable, precision: Any) -> Callable:
    """`loss_fn` as is for fp32; for bf16, the same loss computed in bfloat16 (see above)."""
    if Precision(precision) is Precision.fp32:
        return loss_fn

    def bf16_loss(model: nnx.Module, batch: Mapping[str, jax.Array], rngs: nnx.Rngs):
        graph, params, rest = nnx.split(model, nnx.Param, ...)
        low = nnx.merge(graph, lowered(params), rest)
        loss, metrics = loss_fn(low, lowered(dict(batch)), rngs)
        # BatchNorm statistics and RNG counts moved on in the bfloat16 copy: carry them back,
        # in the dtypes they had.
        moved = nnx.state(low, nnx.Not(nnx.Param))
        nnx.update(model, jax.tree.map(lambda new, old: new.astype(old.dtype), moved, rest))
        return as_float32(loss), {name: as_float32(value) for name, value in metrics.items()}

    return bf16_loss


def computing(model: nnx.Module, precision: Any) -> nnx.Module:
    """`model` to call outside training as the run computed: itself for fp32; for bf16 a copy
    whose float params are bfloat16 (the trained float32 params stay as they are)."""
    if Precision(precision) is Precision.fp32:
        return model
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    return nnx.merge(graph, lowered(params), rest, copy=True)


def lowered(tree: Any) -> Any:
    """Every float32 array of `tree` in bfloat16; everything else (ints, keys) as it is."""
    return jax.tree.map(lambda x: x.astype(COMPUTE) if x.dtype == jnp.float32 else x, tree)


def as_float32(x: jax.Array) -> jax.Array:
    return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x

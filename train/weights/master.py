"""Float32 master weights for params held in a low precision (`model.param_dtype=bf16`).

A bfloat16 param keeps 8 bits of mantissa: an update smaller than half its spacing (an Adam step
of 1e-4 on a weight near 0.3, whose neighbours are 2^-9 apart) rounds back to the param it was
applied to, so training bfloat16 params alone stalls where float32 training moves. Here each
trained param has a float32 master: the gradient is taken in float32, the optimizer's own state
(Adam's moments, the EMA) is float32 and computed against the masters, each update is added to
the master, and the param becomes its master rounded after every step.

The optimizer state holds each master as the float32 remainder that rounding dropped (master =
param + remainder, exactly: a float32 number minus its bfloat16 rounding is a float32 number):
the same memory as a copy, and weights that a run loads into its params after the optimizer is
made (`finetune.init_from`, a pretrained checkpoint) are their own masters, with nothing to keep
in step. Being optimizer state, the remainders are sharded like their params, saved in every
checkpoint and restored on resume, so a resumed run continues bit for bit.

Only what is trained gets a master: frozen params and a LoRA run's base weights are read, never
updated, and stay in bfloat16 alone: that is what halves a fine-tuning run's memory. When a run
trains any low-precision param, every trained param gets a master (a float32 param's remainder
stays zero), which keeps the optimizer state one tree beside the params.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

MASTER = jnp.float32


class MasterState(NamedTuple):
    remainder: Any  # master - param, float32, per trained param
    inner: Any  # the optimizer's own state, of the float32 masters


def is_low_precision(x: Any) -> bool:
    """A floating array held in fewer bits than float32."""
    return jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize < 4


def masters(params: Any, remainder: Any) -> Any:
    """The float32 masters of `params` (pytrees alike)."""
    return jax.tree.map(lambda p, r: p.astype(MASTER) + r, params, remainder)


def with_master_weights(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` run in float32 against the params' float32 masters. Its update returns the new
    params themselves, not updates to add: `MasterWeightsOptimizer` assigns them (adding a
    float32 difference to a bfloat16 param may round to another neighbour of the master)."""

    def init(params):
        master = jax.tree.map(lambda p: p.astype(MASTER), params)
        return MasterState(jax.tree.map(jnp.zeros_like, master), tx.init(master))

    def update(grads, state, params):
        master = masters(params, state.remainder)
        grads = jax.tree.map(lambda g: g.astype(MASTER), grads)
        updates, inner = tx.update(grads, state.inner, master)
        master = optax.apply_updates(master, updates)
        rounded = jax.tree.map(_rounded, master, params)
        new_params = jax.tree.map(lambda r, p: r.astype(p.dtype), rounded, params)
        remainder = jax.tree.map(jnp.subtract, master, rounded)
        return new_params, MasterState(remainder, inner)

    return optax.GradientTransformation(init, update)


def _rounded(master: jax.Array, param: jax.Array) -> jax.Array:
    """`master` rounded to `param`'s precision, still float32. An explicit rounding: XLA may
    drop a float32 -> bfloat16 -> float32 round trip as excess precision, which would leave a
    remainder of zero."""
    info = jnp.finfo(param.dtype)
    return jax.lax.reduce_precision(master, exponent_bits=info.nexp, mantissa_bits=info.nmant)


class MasterWeightsOptimizer(nnx.Optimizer):
    """An `nnx.Optimizer` that trains its params against float32 masters (see the module
    docstring): each update leaves every trained param its master rounded to its dtype."""

    def __init__(self, model: nnx.Module, tx: optax.GradientTransformation, *, wrt: Any):
        super().__init__(model, with_master_weights(tx), wrt=wrt)

    def update(self, model: nnx.Module, grads: Any, /, **kwargs: Any) -> Any:
        """`nnx.Optimizer.update`, with the new params assigned rather than added."""
        params = nnx.as_pure(nnx.state(model, self.wrt, graph=self.graph))
        new_params, new_state = self.tx.update(
            nnx.as_pure(nnx.state(grads, self.wrt, graph=self.graph)),
            nnx.as_pure(self.opt_state),
            params,
            **nnx.as_pure(kwargs),
        )
        nnx.update(model, new_params)
        nnx.update(self.opt_state, nnx.state(new_state, graph=self.graph))
        self.step[...] += 1
        return new_params


def optimizer_for(model: nnx.Module, tx: optax.GradientTransformation, wrt: Any) -> nnx.Optimizer:
    """The optimizer of `model`'s params that `wrt` selects: with float32 master weights when
    any of them is held in a low precision, else the plain `nnx.Optimizer`."""
    trained = jax.tree.leaves(nnx.state(model, wrt))
    if any(is_low_precision(x) for x in trained):
        return MasterWeightsOptimizer(model, tx, wrt=wrt)
    return nnx.Optimizer(model, tx, wrt=wrt)


def inner_state(opt_state: Any) -> Any:
    """The optimizer's own state: `opt_state` itself, unless master weights wrap it."""
    return opt_state.inner if isinstance(opt_state, MasterState) else opt_state

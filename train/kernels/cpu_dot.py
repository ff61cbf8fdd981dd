"""A dense layer's product for bfloat16 on a CPU, written so that XLA:CPU takes its bfloat16 path
in the forward pass and in both products of the backward pass.

jaxlib's XLA:CPU multiplies bfloat16 matrices on the CPU's bfloat16 instructions (YNNPACK) only
for a product that asks for a float32 result with both operands in the plain `a @ b` layout: the
first's trailing axes against the second's leading ones, each laid out row-major. Any other
product, a bfloat16 result or the transposed products autodiff writes for the backward pass
(`dy @ w.T`, `x.T @ dy`), is rewritten early on (XLA's operand upcaster, before its layout and
simplification passes) to convert both operands to float32 first, so a bfloat16 step would run
at float32 speed. Here the product is a `jax.custom_vjp` whose three products are each plain,
ask for float32 and round to bfloat16 after: the arithmetic of XLA's bfloat16 `dot` (bfloat16
operands, float32 sums, one rounding), with its float32 copies of both operands gone. The
backward pass's transposed operand is copied transposed first (see `_materialised`): a
memory-bound copy of one operand, small beside the product it feeds.

A kernel held (outputs..., inputs...) (`zoo.engine.kernels.dense.TransposedLinear`) takes the same
product with `outputs_first`: its forward product reads the kernel copied transposed, the input's
gradient reads it as held, and the kernel's gradient reads the output's gradient copied
transposed.

In float32 on a CPU, a kernel with no more inputs than outputs, held either way (a decoder's
query, key, value and gate/up projections; gpt's and vit's query, key, value, attention output
and first MLP layer) takes `wide_outputs`: the same forward product and input gradient as
`jax.lax.dot_general`'s, and a kernel gradient made from the input copied transposed, x.T @ dy
(transposed after for a kernel held outputs first), rather than from the output's gradient
transposed. XLA:CPU otherwise writes dy.T with the ops that make dy (a SwiGLU's derivative, the
rotary positions' inverse, the residual stream's additions) fused into the transposing copy,
several times slower than a plain copy; the input is the same for all the projections that read
it (one copy for query, key and value) and has the fewer features. Only the order of the sums of
the kernel gradient changes."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

WIDE = jnp.float32


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
    out_sharding: Any = None,
) -> jax.Array:
    """`jax.lax.dot_general`, for `nnx.Linear(dot_general=...)`: on a CPU, a product of two
    bfloat16 arrays contracting the first's trailing axes with the second's leading ones (a
    dense layer's) or trailing ones (a kernel held outputs first) takes `product`, a float32
    one with no more inputs than outputs `wide_outputs`; every other product is
    `jax.lax.dot_general`'s."""
    contracted, outputs_first = _dense_contraction(lhs, rhs, dimension_numbers)
    if contracted and _on_bf16_path(lhs, rhs, precision, preferred_element_type):
        return product(lhs, rhs, contracted, out_sharding, outputs_first)
    if contracted and _wide_outputs(
        lhs, rhs, contracted, outputs_first, precision, preferred_element_type
    ):
        return wide_outputs(lhs, rhs, contracted, out_sharding, outputs_first)
    return jax.lax.dot_general(
        lhs,
        rhs,
        dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
        out_sharding=out_sharding,
    )


def _dense_contraction(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any) -> tuple[int, bool]:
    """How many axes a product contracts if it is a dense layer's (lhs's trailing axes against
    rhs's leading ones, or its trailing ones, in order, no batch axes), else 0; and whether they
    are rhs's trailing ones (a kernel held outputs first)."""
    (lhs_axes, rhs_axes), (lhs_batch, rhs_batch) = dimension_numbers
    lhs_axes = tuple(a % lhs.ndim for a in lhs_axes)
    rhs_axes = tuple(a % rhs.ndim for a in rhs_axes)
    k = len(lhs_axes)
    if not k or lhs_batch or rhs_batch or lhs.ndim <= k or rhs.ndim <= k:
        return 0, False
    if lhs_axes != tuple(range(lhs.ndim - k, lhs.ndim)):
        return 0, False
    outputs_first = rhs_axes == tuple(range(rhs.ndim - k, rhs.ndim))
    return (k if outputs_first or rhs_axes == tuple(range(k)) else 0), outputs_first


def _on_cpu_in(dtype: Any, lhs: jax.Array, rhs: jax.Array, precision: Any, preferred: Any) -> bool:
    """Whether a product runs on a CPU with both operands and its result in `dtype`, at the
    default precision."""
    dtype = jnp.dtype(dtype)
    return (
        jax.default_backend() == "cpu"
        and lhs.dtype == rhs.dtype == dtype
        and precision is None
        and (preferred is None or jnp.dtype(preferred) == dtype)
    )


def _on_bf16_path(lhs: jax.Array, rhs: jax.Array, precision: Any, preferred: Any) -> bool:
    return _on_cpu_in(jnp.bfloat16, lhs, rhs, precision, preferred)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def product(
    x: jax.Array,
    w: jax.Array,
    contracted: int,
    out_sharding: Any = None,
    outputs_first: bool = False,
) -> jax.Array:
    """x's trailing `contracted` axes against w's leading ones (its trailing ones with
    `outputs_first`), in bfloat16 with float32 sums, its gradients computed the same way (see
    the module's doc)."""
    return _forward(x, w, contracted, out_sharding, outputs_first)[0]


def _forward(x, w, contracted, out_sharding, outputs_first):
    w_in_first = _materialised(_rolled(w, w.ndim - contracted)) if outputs_first else w
    return _plain(x, w_in_first, contracted, out_sharding), (x, w)


def _backward(contracted, out_sharding, outputs_first, residuals, dy):
    x, w = residuals
    batch, outputs = x.ndim - contracted, w.ndim - contracted
    if outputs_first:
        dx = _plain(dy, w, outputs, _sharding(x))
        dw = _plain(_materialised(_rolled(dy, batch)), x, batch, _sharding(w))
    else:
        dx = _plain(dy, _materialised(_rolled(w, contracted)), outputs, _sharding(x))
        dw = _plain(_materialised(_rolled(x, batch)), dy, batch, _sharding(w))
    return dx, dw


def _rolled(a: jax.Array, leading: int) -> jax.Array:
    """`a` with its first `leading` axes moved last, in order: a kernel (inputs..., outputs...)
    as (outputs..., inputs...) and back, or an activation (batch..., features...) as
    (features..., batch...)."""
    return jnp.transpose(a, (*range(leading, a.ndim), *range(leading)))


product.defvjp(_forward, _backward)


def _wide_outputs(
    lhs, rhs, contracted: int, outputs_first: bool, precision: Any, preferred: Any
) -> bool:
    """Whether a float32 dense product goes to `wide_outputs` (on a CPU, a kernel with no more
    inputs than outputs)."""
    outputs = rhs.ndim - contracted
    inputs_at = slice(outputs, None) if outputs_first else slice(None, contracted)
    outputs_at = slice(None, outputs) if outputs_first else slice(contracted, None)
    on_cpu = _on_cpu_in(WIDE, lhs, rhs, precision, preferred)
    return on_cpu and math.prod(rhs.shape[inputs_at]) <= math.prod(rhs.shape[outputs_at])


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def wide_outputs(
    x: jax.Array,
    w: jax.Array,
    contracted: int,
    out_sharding: Any = None,
    outputs_first: bool = False,
) -> jax.Array:
    """x's trailing `contracted` axes against w's leading ones (its trailing ones with
    `outputs_first`), as `jax.lax.dot_general`, its kernel gradient from x copied transposed
    (see the module's doc)."""
    return _wide_forward(x, w, contracted, out_sharding, outputs_first)[0]


def _wide_forward(x, w, contracted, out_sharding, outputs_first):
    w_inputs = range(w.ndim - contracted, w.ndim) if outputs_first else range(contracted)
    axes = (tuple(range(x.ndim - contracted, x.ndim)), tuple(w_inputs))
    return jax.lax.dot_general(x, w, (axes, ((), ())), out_sharding=out_sharding), (x, w)


def _wide_backward(contracted, out_sharding, outputs_first, residuals, dy):
    x, w = residuals
    batch, outputs = x.ndim - contracted, w.ndim - contracted
    # The input's gradient as jax's transpose of the forward product writes it.
    w_outputs = range(outputs) if outputs_first else range(contracted, w.ndim)
    axes = (tuple(range(batch, dy.ndim)), tuple(w_outputs))
    dx = jax.lax.dot_general(dy, w, (axes, ((), ())), out_sharding=_sharding(x))
    inputs_first = _sharding(w)
    if outputs_first and inputs_first is not None:
        spec = (*inputs_first.spec, *(None,) * (w.ndim - len(inputs_first.spec)))
        inputs_first = inputs_first.update(spec=P(*spec[outputs:], *spec[:outputs]))
    dw = _plain(_materialised(_rolled(x, batch)), dy, batch, inputs_first)
    return dx, _rolled(dw, contracted) if outputs_first else dw


wide_outputs.defvjp(_wide_forward, _wide_backward)


def _plain(a: jax.Array, b: jax.Array, contracted: int, out_sharding: Any) -> jax.Array:
    axes = (tuple(range(a.ndim - contracted, a.ndim)), tuple(range(contracted)))
    wide = jax.lax.dot_general(
        a, b, (axes, ((), ())), preferred_element_type=WIDE, out_sharding=out_sharding
    )
    return wide.astype(a.dtype)


def _materialised(transposed: jax.Array) -> jax.Array:
    """`transposed` as a row-major copy that XLA cannot fold back into the product reading it.
    A transpose alone reaches the product as a transposed layout, which the upcaster turns to
    float32; behind an optimization barrier it still does (the barrier keeps the layout). A
    reshape through the barrier (adding a leading axis and taking it away) is not a layout
    change, so the copy happens before it and the product sees a plain operand."""
    return jax.lax.optimization_barrier(transposed[None])[0]


def _sharding(a: jax.Array) -> Any:
    """The sharding a gradient takes, its array's, where that is typed over a mesh with
    explicit axes: a backward product contracting the batch, split on both operands, needs it
    named (a replicated array's too)."""
    sharding = getattr(jax.typeof(a), "sharding", None)
    types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
    explicit = jax.sharding.AxisType.Explicit in types
    return sharding if explicit and getattr(sharding, "spec", None) is not None else None

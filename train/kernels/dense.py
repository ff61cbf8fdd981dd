"""A dense layer whose kernel is laid out (outputs..., inputs...), as PyTorch's `nn.Linear`
stores its weight and as safetensors checkpoints of Llama, Qwen, Mistral and Gemma hold it.

`nnx.Linear` keeps (inputs, outputs), so every projection of such a checkpoint would go through
a transposed copy at load and another at export: for a 0.6B-parameter model that copy costs
several times the read of the file itself (a transposed copy runs at a fraction of memory
speed). Held as the checkpoint holds it, a projection loads with a straight copy (a reshape at
most), and the contraction over the kernel's last axes costs the same as over its first (XLA
picks the operand order of the dot). In bfloat16 on a CPU the product of more than `FEW_ROWS`
rows and its gradients are `zoo.engine.kernels.cpu_dot`'s (XLA:CPU's bfloat16 path); a few rows (a
decoding step's) are `zoo.engine.kernels.bf16_rows`'s where that kernel runs, else a decoding
session's float32 copy of the kernel's (`zoo.engine.kernels.widened`) where it made one."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.dtypes import promote_dtype
from jax.sharding import PartitionSpec as P
from zoo.engine.kernels import bf16_rows, cpu_dot, widened
from zoo.engine.sharding.abstract import partitioned


def _shape(features: int | Sequence[int]) -> tuple[int, ...]:
    return (features,) if isinstance(features, int) else tuple(features)


class TransposedLinear(nnx.Module):
    """y = x . kernel + bias, contracting the last `len(in_features)` axes of x with the last
    axes of `kernel` (shape `(*out_features, *in_features)`) and giving `out_features` in their
    place. `kernel_axes`: the kernel's logical axes in that order (outputs first); `bias_axes`
    the bias's (shape `out_features`). Initialised as lecun_normal over the input axes."""

    def __init__(
        self,
        in_features: int | Sequence[int],
        out_features: int | Sequence[int],
        *,
        kernel_axes: tuple[Any, ...],
        bias_axes: tuple[Any, ...] | None = None,
        use_bias: bool = False,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.in_features, self.out_features = _shape(in_features), _shape(out_features)
        outputs, inputs = len(self.out_features), len(self.in_features)
        init = nnx.initializers.lecun_normal(
            in_axis=tuple(range(outputs, outputs + inputs)), out_axis=tuple(range(outputs))
        )
        shape = (*self.out_features, *self.in_features)
        self.kernel = nnx.Param(partitioned(init, kernel_axes)(rngs.params(), shape, param_dtype))
        self.bias = (
            nnx.Param(
                partitioned(nnx.initializers.zeros_init(), bias_axes or (None,) * outputs)(
                    rngs.params(), self.out_features, param_dtype
                )
            )
            if use_bias
            else None
        )

    def __call__(self, x: jax.Array, out_sharding: Any = None) -> jax.Array:
        kernel = self.kernel[...]
        bias = None if self.bias is None else self.bias[...]
        x, kernel, bias = promote_dtype((x, kernel, bias))
        y = outputs_first_product(x, kernel, len(self.in_features), out_sharding)
        return y if bias is None else y + bias


def outputs_first_product(
    x: jax.Array, kernel: jax.Array, inputs: int = 1, out_sharding: Any = None
) -> jax.Array:
    """x (batch..., inputs...) . kernel (outputs..., inputs...) over the last `inputs` axes of
    both: a `TransposedLinear`'s product, or logits through a tied embedding table."""
    batch = x.ndim - inputs
    x_axes, kernel_axes = range(batch, x.ndim), range(kernel.ndim - inputs, kernel.ndim)
    few = math.prod(x.shape[:batch]) <= FEW_ROWS
    if few and bf16_rows.applies(x, kernel):
        return bf16_rows.product(x, kernel, inputs, out_sharding)
    if not few:
        contracted = (tuple(x_axes), tuple(kernel_axes))
        return cpu_dot.dot_general(x, kernel, (contracted, ((), ())), out_sharding=out_sharding)
    # A decoding session's float32 copy of a bfloat16 kernel where zoo's kernel does not run:
    # the same arithmetic as XLA's bfloat16 product, without widening the kernel at every step.
    copy = widened.copy_of(kernel) if x.dtype == jnp.bfloat16 else None
    # The kernel first: XLA:CPU would otherwise copy it transposed on every call.
    outputs = kernel.ndim - inputs
    spec = None if out_sharding is None else P(*out_sharding[batch:], *out_sharding[:batch])
    contracted = (tuple(kernel_axes), tuple(x_axes))
    operands = (kernel, x) if copy is None else (copy, x.astype(jnp.float32))
    y = jax.lax.dot_general(*operands, (contracted, ((), ())), out_sharding=spec)
    y = jnp.moveaxis(y, tuple(range(outputs)), tuple(range(batch, batch + outputs)))
    return y if copy is None else y.astype(jnp.bfloat16)


FEW_ROWS = 64
"""Inputs of at most this many rows (a decoding step's tokens) are multiplied by zoo's bfloat16
kernel where it runs (`zoo.engine.kernels.bf16_rows`), else kernel first: with the input first, XLA:CPU
copies a kernel of several output axes (heads x head size) transposed before every product,
which for one token costs more than the product (a (16, 128, 1024) kernel: 1.9 ms against
0.35 ms). For more rows the copy is small beside the product, and the input-first order needs
no transpose of the output."""

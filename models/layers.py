"""Layers with logical sharding annotations, so every model of the zoo shards the same way.

Each param names its dimensions with logical axes (`embed`, `mlp`, `heads`, `conv_in`,
`conv_out`); the run's `mesh.rules` map them onto the mesh. Every kernel has a dimension named
for FSDP (`embed` or `conv_in`), so that under `mesh.fsdp=N` each device holds 1/N of it. A 1-D param (bias, norm scale) is
never put on an axis that also shards the batch (`embed` -> `fsdp` by default): the elementwise
op with a batch-sharded activation would use that mesh axis twice.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import jax
from flax import nnx

from zoo.plugin import (
    construction_rngs,
    dense_dot_general,
    logical_spec,
    partitioned,
    repeated,
)

Axis = str | tuple[str, ...] | None  # one logical name, several (split on all their axes), none
Axes = tuple[Axis, ...]
_ZEROS, _ONES = nnx.initializers.zeros_init(), nnx.initializers.ones_init()
_LECUN = nnx.initializers.lecun_normal()


def dense(
    din: int,
    dout: int,
    axes: Axes,
    *,
    rngs: nnx.Rngs,
    use_bias: bool = True,
) -> nnx.Linear:
    """A Linear layer whose kernel is annotated `axes` = (input axis, output axis); its bias
    follows the output axis unless that is `embed`. Its product in bfloat16 on a CPU is
    `zoo.plugin.dense_dot_general`'s (XLA:CPU's bfloat16 path, backward pass included)."""
    bias_axis = None if axes[1] == "embed" else axes[1]
    return nnx.Linear(
        din,
        dout,
        use_bias=use_bias,
        kernel_init=partitioned(_LECUN, axes),
        bias_init=partitioned(_ZEROS, (bias_axis,)),
        dot_general=dense_dot_general,
        rngs=rngs,
    )


def head_projections(
    dim: int, num_heads: int, *, rngs: nnx.Rngs, use_bias: bool = False
) -> tuple[nnx.LinearGeneral, ...]:
    """Attention's query, key, value and output projections (biases with `use_bias`): `dim`
    features <-> (`num_heads`, dim // num_heads), the heads on the logical `heads` axis. The
    output projection sums over heads: call it with `out_sharding` where heads are sharded."""

    def projection(in_features, out_features, axis, axes):
        bias_axes = (axes[1], None) if axes[0] == "embed" else (None,)
        return nnx.LinearGeneral(
            in_features,
            out_features,
            axis=axis,
            use_bias=use_bias,
            kernel_init=partitioned(_LECUN, axes),
            bias_init=partitioned(_ZEROS, bias_axes),
            dot_general=dense_dot_general,
            rngs=rngs,
        )

    head_dim = dim // num_heads
    query, key, value = (
        projection(dim, (num_heads, head_dim), -1, ("embed", "heads", None)) for _ in range(3)
    )
    out = projection((num_heads, head_dim), dim, (-2, -1), ("heads", None, "embed"))
    return query, key, value, out


def split_by_fsdp(axis: str | None) -> Axis:
    """The logical names of a kernel's input features that `axis` names (None: none), split by
    FSDP too (`embed`): for a layer, such as a classifier head, whose output features no axis
    splits, so that its kernel still has a dimension that FSDP divides."""
    return "embed" if axis in (None, "embed") else (axis, "embed")


def conv(
    cin: int,
    cout: int,
    kernel_size: int,
    *,
    rngs: nnx.Rngs,
    strides: int = 1,
    use_bias: bool = False,
    padding: str | Sequence[tuple[int, int]] = "SAME",
    in_axis: str | None = "conv_in",
    out_axis: str = "conv_out",
) -> nnx.Conv:
    """A 2-D convolution, channels last, kernel annotated (None, None, `in_axis`, `out_axis`).
    No bias by default: convolutions here are followed by a BatchNorm, whose shift replaces it.
    A convolution whose output is `embed` (`fsdp`) leaves its input channels unnamed (`conv_in`
    is `fsdp` too)."""
    bias_axis = None if out_axis == "embed" else out_axis
    return nnx.Conv(
        cin,
        cout,
        (kernel_size, kernel_size),
        strides=strides,
        padding=padding,
        use_bias=use_bias,
        kernel_init=partitioned(nnx.initializers.he_normal(), (None, None, in_axis, out_axis)),
        bias_init=partitioned(_ZEROS, (bias_axis,)),
        rngs=rngs,
    )


def batch_norm(
    features: int, *, rngs: nnx.Rngs, axis: str | None = "conv_out", zero_scale: bool = False
) -> nnx.BatchNorm:
    """BatchNorm with momentum 0.9: the running statistics of a short run settle within a few
    hundred steps (Flax's default 0.99 needs thousands). `zero_scale` starts the layer at zero,
    so a residual block starts as the identity."""
    return nnx.BatchNorm(
        features,
        momentum=0.9,
        scale_init=partitioned(_ZEROS if zero_scale else _ONES, (axis,)),
        bias_init=partitioned(_ZEROS, (axis,)),
        rngs=rngs,
    )


def learned(shape: tuple[int, ...], axes: Axes, *, rngs: nnx.Rngs) -> nnx.Param:
    """A learned array (positions, a class token, an embedding table) annotated `axes`, drawn
    from a normal distribution of std 0.02 with one key of `rngs.params`."""
    return nnx.Param(partitioned(nnx.initializers.normal(0.02), axes)(rngs.params(), shape))


def layer_stack(
    layer: Callable[..., nnx.Module], depth: int, stacked: bool, key: jax.Array
) -> nnx.Module:
    """`depth` layers `layer(rngs=...)`, layer i initialised from the i-th of `key`'s split
    whether they are `stacked` (one layer whose params have a leading, unsharded layer axis,
    for `nnx.scan`) or not (an `nnx.List`), so both layouts hold the same weights."""

    def one(key: jax.Array) -> nnx.Module:
        return layer(rngs=construction_rngs(params=key))

    keys = jax.random.split(key, depth)
    if stacked:
        return nnx.vmap(one, transform_metadata={nnx.PARTITION_NAME: None})(keys)
    return nnx.List(repeated(lambda i: one(keys[i]), depth))


def layer_norm(features: int, *, rngs: nnx.Rngs, epsilon: float = 1e-6) -> nnx.LayerNorm:
    """LayerNorm over `embed` features; its params are replicated (see the module docstring)."""
    return nnx.LayerNorm(
        features,
        epsilon=epsilon,
        scale_init=partitioned(_ONES, (None,)),
        bias_init=partitioned(_ZEROS, (None,)),
        rngs=rngs,
    )


def dense_stack(sizes: Sequence[int], *, rngs: nnx.Rngs) -> nnx.List:
    """Dense layers `sizes[0] -> sizes[1] -> ...`, alternating column- and row-parallel
    (Megatron style): kernels (embed, mlp), then (mlp, embed), so tensor parallelism needs one
    reduction per pair of layers and fsdp shards every kernel. Run it with `run_stack`."""
    return nnx.List(
        [
            dense(din, dout, ("embed", "mlp") if i % 2 == 0 else ("mlp", "embed"), rngs=rngs)
            for i, (din, dout) in enumerate(itertools.pairwise(sizes))
        ]
    )


def stack_output_axis(stack: nnx.List) -> str:
    """The logical axis of a `dense_stack`'s output features."""
    return "mlp" if len(stack) % 2 else "embed"


def run_stack(stack: nnx.List, x: jax.Array, after: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """`after(layer(x))` through every layer of a `dense_stack` (an activation, dropout)."""
    for i, layer in enumerate(stack):
        # Row-parallel layers sum over tensor-sharded features: say where the sum lands.
        out = logical_spec("batch", "mlp" if i % 2 == 0 else None)
        x = after(layer(x, out_sharding=out))
    return x

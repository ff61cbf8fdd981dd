"""The quantized base kernel of a QLoRA adapter: codes and scales, and the kernel they stand for.

qwix quantizes a kernel with one scale per output channel and per block of `TILE` values along
its last input axis (where `TILE` divides it; else one scale for the whole axis), the other
input axes channelwise too, so every scale covers at most `TILE` weights of one output. `int8`
keeps one code a byte; `int4` and `nf4` (NormalFloat, 16 levels placed at a normal
distribution's quantiles) keep two codes a byte, packed here along the last input axis: jax
holds an `int4` or `uint4` array with a byte per value, which would spend half of what the
4-bit codes save. The scales are held in the kernel's dtype, which the dequantized kernel has.

`mxfp4` is the OCP Microscaling format gpt-oss's hub files store their experts in
(`zoo.engine.weights.mxfp4`), quantized here rather than by qwix: FP4 (E2M1) codes, two a byte
(the earlier value in the low half, as the hub packs them), and per block of `MXFP4_BLOCK`
inputs one power of two, held as its biased exponent byte. Each block takes the smallest power
of two that brings its largest magnitude within FP4's 6, and each value the nearest FP4 value:
a kernel decoded from MXFP4 (every value of a block an FP4 value times its power of two) is
quantized exactly, and dequantizes to itself bit for bit.

`held` puts codes and scales in the place of a kernel, `store` quantizes a kernel into them;
`Quantized` is a kernel held so in the place of a module's `nnx.Param` (a mixture's stacked
expert kernels under QLoRA), read with `[...]` as the param is.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from zoo.engine.weights.mxfp4 import FP4_VALUES

QTYPES = ("int8", "int4", "nf4")
"""The base-weight formats that qwix quantizes to."""
MXFP4 = "mxfp4"
FORMATS = (*QTYPES, MXFP4)
"""The base-weight formats of a QLoRA fine-tune (`finetune.quantize`)."""
TILE = 64
"""Weights per scale along a kernel's last input axis (qwix's formats)."""
MXFP4_BLOCK = 32
"""Weights per power of two along it (MXFP4)."""
_EXPONENT_BIAS = 127
_OFFSET = {"int4": 8, "nf4": 0}  # what maps a 4-bit code (int4: -8..7, nf4: 0..15) to 0..15


class QuantizedKernel(nnx.Variable):
    """Codes or scales of a quantized base kernel: state the model holds and checkpoints, but
    not a param, so no gradient, optimizer state or weight decay ever touches it."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a kernel is quantized: its shape and dtype, the format, and the axis tiled by `TILE`
    and, for 4-bit codes, packed two a byte (the last of those the layer contracts with its
    input)."""

    shape: tuple[int, ...]
    dtype: Any
    axis: int
    qtype: str

    @property
    def packed(self) -> bool:
        return self.qtype != "int8" and self.shape[self.axis] % 2 == 0

    @property
    def tile(self) -> int:
        return MXFP4_BLOCK if self.qtype == MXFP4 else TILE

    @property
    def tiled(self) -> bool:
        return self.shape[self.axis] % self.tile == 0


@functools.partial(jax.jit, static_argnums=1)
def quantize(kernel: jax.Array, layout: Layout) -> tuple[jax.Array, jax.Array]:
    """(codes, scales) of `kernel`, gathered whole first (qwix flattens it); the same bits
    every time."""
    import qwix  # here: only a quantized fine-tune needs it

    kernel = _whole(kernel)
    if layout.qtype == MXFP4:
        nibbles, exponents = _mxfp4(kernel, layout)
        return (_pack(nibbles, layout.axis) if layout.packed else nibbles), exponents
    channels = tuple(axis for axis in range(kernel.ndim) if axis != layout.axis)
    tiles = {layout.axis: TILE} if layout.tiled else {}
    q = qwix.quantize(
        kernel, layout.qtype, channelwise_axes=channels, tiled_axes=tiles, scale_dtype=layout.dtype
    )
    if layout.qtype == "int8":
        return q.qvalue, q.scale
    nibbles = (q.qvalue.astype(jnp.int8) + _OFFSET[layout.qtype]).astype(jnp.uint8)
    return (_pack(nibbles, layout.axis) if layout.packed else nibbles), q.scale


def dequantize(codes: jax.Array, scale: jax.Array, layout: Layout) -> jax.Array:
    """The kernel that `codes` and `scale` stand for, in the kernel's dtype: each code's value
    (an nf4 code's from the NormalFloat table) times its scale. Sharded as the codes are,
    except along the last input axis, which tiles and packed pairs cut. MXFP4's: each FP4
    value times its power of two, exactly (`ldexp`, as the hub's decoding), in float32 first."""
    codes, scale = _whole_along(codes, layout.axis), _whole_along(scale, layout.axis)
    scaled = jnp.multiply
    if layout.qtype == MXFP4:
        nibbles = _unpack(codes, layout.axis) if layout.packed else codes
        values, scale = (
            _lookup(jnp.asarray(FP4_VALUES), nibbles),
            scale.astype(jnp.int32) - _EXPONENT_BIAS,
        )
        scaled = jnp.ldexp
    elif layout.qtype == "int8":
        values = codes.astype(layout.dtype)
    else:
        nibbles = _unpack(codes, layout.axis) if layout.packed else codes
        if layout.qtype == "nf4":
            from qwix._src.core import numerics

            values = _lookup(numerics.get_nf4_buckets().astype(layout.dtype), nibbles)
        else:
            values = nibbles.astype(layout.dtype) - _OFFSET[layout.qtype]
    if not layout.tiled:
        return scaled(values, scale).astype(layout.dtype)
    axis, shape, tile = layout.axis, values.shape, layout.tile
    tiles = values.reshape((*shape[:axis], shape[axis] // tile, tile, *shape[axis + 1 :]))
    return scaled(tiles, jnp.expand_dims(scale, axis + 1)).reshape(shape).astype(layout.dtype)


def _mxfp4(kernel: jax.Array, layout: Layout) -> tuple[jax.Array, jax.Array]:
    """(FP4 codes, one per value, and biased exponent bytes, one per block) of `kernel`
    (module docstring): each block's exponent the smallest that brings its largest magnitude
    within 6, each code the nearest FP4 value's (bit 3 the sign, a negative zero's too)."""
    axis, shape = layout.axis, kernel.shape
    tile = layout.tile if layout.tiled else shape[axis]
    blocks = kernel.astype(jnp.float32).reshape(
        (*shape[:axis], shape[axis] // tile, tile, *shape[axis + 1 :])
    )
    largest = jnp.max(jnp.abs(blocks), axis=axis + 1, keepdims=True)
    fraction, exponent = jnp.frexp(largest / 6)  # largest / 6 = fraction x 2^exponent
    exponent = jnp.where(fraction == 0.5, exponent - 1, exponent)
    exponent = jnp.clip(jnp.where(largest > 0, exponent, -_EXPONENT_BIAS), -127, 127)
    steps = jnp.clip(jnp.abs(jnp.ldexp(blocks, -exponent)), 0, 6)
    magnitude = jnp.argmin(jnp.abs(steps[..., None] - jnp.asarray(FP4_VALUES[:8])), axis=-1).astype(
        jnp.uint8
    )
    codes = magnitude | (jnp.signbit(blocks).astype(jnp.uint8) << 3)
    exponents = (jnp.squeeze(exponent, axis + 1) + _EXPONENT_BIAS).astype(jnp.uint8)
    return codes.reshape(shape), exponents


def held(
    kernel: nnx.Variable, axis: int, qtype: str, filled: bool, axes: tuple[Any, ...]
) -> tuple[Layout, QuantizedKernel, QuantizedKernel]:
    """(layout, codes, scales) of `kernel` quantized along its input axis `axis`: the codes
    held with the kernel's logical `axes`, the scales with them but along `axis`, where they
    are few (one per `TILE` codes, or one for all of them) and are not split. `filled`: a
    checkpoint fills the kernel next, so they start as zeros (the random initialisation is
    then never computed, nor quantized)."""
    layout = Layout(tuple(kernel.shape), jnp.dtype(kernel.dtype), axis % kernel.ndim, qtype)
    if filled:
        shapes = jax.eval_shape(quantize, kernel[...], layout)
        codes, scale = (jnp.zeros(s.shape, s.dtype) for s in shapes)
    else:
        codes, scale = quantize(kernel[...], layout)
    scale_axes = tuple(None if i == layout.axis else name for i, name in enumerate(axes))
    return (
        layout,
        QuantizedKernel(codes, out_sharding=axes),
        QuantizedKernel(scale, out_sharding=scale_axes),
    )


def store(codes: QuantizedKernel, scale: QuantizedKernel, kernel: jax.Array, layout: Layout):
    """Quantize `kernel` into `codes` and `scale`, each kept where it lived."""
    for variable, value in zip((codes, scale), quantize(kernel, layout)):
        current = variable.get_value()
        if isinstance(current, jax.Array):
            value = jax.device_put(value, current.sharding)
        variable.set_value(value)


class Quantized(nnx.Module):
    """A kernel held as codes and scales in the place of a module's `nnx.Param`, quantized
    along its last axis (the one its module contracts with the input): `[...]` reads the
    kernel they stand for, dequantized, as the param read it, so the module computes as it
    did. The codes keep the kernel's logical axes (`held`), and each device dequantizes the
    slices of its other axes that it holds, gathered along the last (a mixture's experts: its
    own experts, its part of their hidden width)."""

    def __init__(self, kernel: nnx.Param, qtype: str, filled: bool):
        axes = kernel.get_metadata().get("out_sharding") or (None,) * kernel.ndim
        self.kernel_axes = tuple(axes)
        self.layout, self.codes, self.scale = held(kernel, -1, qtype, filled, self.kernel_axes)

    def __getitem__(self, index: Any) -> jax.Array:
        return dequantize(self.codes[...], self.scale[...], self.layout)[index]

    def set_base_kernel(self, kernel: jax.Array) -> None:
        """Quantize `kernel` into the codes and scales (a checkpoint's fill)."""
        store(self.codes, self.scale, kernel, self.layout)

    def param(self) -> nnx.Param:
        """The kernel, dequantized, as the param it replaced (sharded by its logical axes)."""
        with nnx.use_eager_sharding(False):
            return nnx.Param(self[...], out_sharding=self.kernel_axes)


def _lookup(table: jax.Array, codes: jax.Array) -> jax.Array:
    spec = jax.typeof(codes).sharding.spec
    if not any(spec):
        return table[codes]
    return table.at[codes].get(out_sharding=spec)


def _whole(x: jax.Array) -> jax.Array:
    if not any(jax.typeof(x).sharding.spec):
        return x
    return jax.sharding.reshard(x, P())


def _whole_along(x: jax.Array, axis: int) -> jax.Array:
    """`x`, gathered along `axis` where a mesh axis splits it (tiles and packed pairs are cut
    along it): the rest of its sharding is kept."""
    spec = list(jax.typeof(x).sharding.spec)
    if axis >= len(spec) or spec[axis] is None:
        return x
    spec[axis] = None
    return jax.sharding.reshard(x, P(*spec))


def _pack(nibbles: jax.Array, axis: int) -> jax.Array:
    """Two 4-bit values a byte: each even position along `axis` in the low half, the next one
    in the high half."""
    size = nibbles.shape[axis]
    even = jax.lax.slice_in_dim(nibbles, 0, size, 2, axis)
    odd = jax.lax.slice_in_dim(nibbles, 1, size, 2, axis)
    return even | (odd << 4)


def _unpack(packed: jax.Array, axis: int) -> jax.Array:
    pairs = jnp.stack([packed & 0xF, packed >> 4], axis=axis + 1)
    shape = list(packed.shape)
    shape[axis] *= 2
    return pairs.reshape(shape)

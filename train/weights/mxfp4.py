"""MXFP4 (the OCP Microscaling format with FP4 elements): how gpt-oss's hub files store their
experts' weights, decoded here bit for bit as transformers' `convert_moe_packed_tensors`
decodes them.

A tensor is stored as two: `blocks` [experts, rows, groups, 16] of bytes, each byte two FP4
(E2M1) codes, the low nibble the earlier value; and `scales` [experts, rows, groups] of bytes,
one per 32 values, each the power of two 2^(byte - 127) that multiplies them. Decoded, a row's
groups lie end to end ([experts, rows, groups x 32]) and the last two axes are swapped: the
logical tensor is [experts, groups x 32, rows], as transformers holds the experts
(`gate_up_proj` [experts, hidden, 2 x intermediate], `down_proj` [experts, intermediate,
hidden]).

Every value is an FP4 value (two significant bits) times a power of two, computed exactly
(`ldexp`, as transformers' `torch.ldexp`: a value past float32's range, which only a scale
byte of 255 gives, is infinite), so it is a bfloat16 number as much as a float32 one: decoding
to the run's dtype, bfloat16 or float32, rounds nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["FP4_VALUES", "dequantize_mxfp4", "mxfp4_shape"]

FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
"""The value of each FP4 (E2M1) code: bit 3 the sign, then two bits of exponent, one of
mantissa."""
_BYTE_PAIRS = np.stack([FP4_VALUES[np.arange(256) & 0x0F], FP4_VALUES[np.arange(256) >> 4]], -1)
"""The two values of each byte [256, 2]: the low nibble's first."""
_ROWS_PER_CHUNK = 1 << 16
"""Groups of 32 values decoded at once: a chunk's float32 temporaries take 8 MiB."""


def mxfp4_shape(
    blocks: tuple[tuple[int, ...], Any], scales: tuple[tuple[int, ...], Any]
) -> tuple[int, int, int]:
    """The decoded tensor's shape from the (shape, dtype) of the stored `blocks` and `scales`;
    a `ValueError` saying why where they do not fit (the reader names the keys)."""
    (block_shape, block_dtype), (scale_shape, scale_dtype) = blocks, scales
    if np.dtype(block_dtype) != np.uint8 or np.dtype(scale_dtype) != np.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales are bytes (U8), and these are {np.dtype(block_dtype)} and "
            f"{np.dtype(scale_dtype)}"
        )
    if len(block_shape) != 4 or tuple(scale_shape) != tuple(block_shape[:-1]):
        raise ValueError(
            f"the blocks have shape {list(block_shape)} and the scales {list(scale_shape)}, where "
            "MXFP4 experts are blocks [experts, rows, groups, bytes] with scales [experts, rows, "
            "groups], one per group"
        )
    experts, rows, groups, size = block_shape
    return (experts, groups * size * 2, rows)


def dequantize_mxfp4(
    blocks: np.ndarray, scales: np.ndarray, *, dtype: Any = np.float32
) -> np.ndarray:
    """The tensor that `blocks` [experts, rows, groups, bytes] and `scales` [experts, rows,
    groups] store, [experts, groups x bytes x 2, rows] in `dtype` (a view swapping the last two
    axes of one contiguous array). Decoded a chunk of rows at a time, straight into the result,
    so that the host holds little more than the result."""
    mxfp4_shape((blocks.shape, blocks.dtype), (scales.shape, scales.dtype))
    experts, rows, groups, size = blocks.shape
    flat_blocks, flat_scales = blocks.reshape(-1, size), scales.reshape(-1)
    out = np.empty((len(flat_blocks), 2 * size), dtype)
    for start in range(0, len(out), _ROWS_PER_CHUNK):
        chunk = slice(start, start + _ROWS_PER_CHUNK)
        with np.errstate(over="ignore"):  # float16's range is narrower: infinite, as theirs
            out[chunk] = _decoded(flat_blocks[chunk], flat_scales[chunk])
    return out.reshape(experts, rows, groups * size * 2).transpose(0, 2, 1)


def _decoded(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Groups [n, bytes] and their scale bytes [n] as float32 values [n, 2 x bytes]: each FP4
    value times its power of two, exactly (`ldexp`, as transformers' `torch.ldexp`)."""
    values = _BYTE_PAIRS[blocks].reshape(len(blocks), -1)
    with np.errstate(over="ignore"):  # 2^128 and more (scale byte 255): infinite, as theirs
        return np.ldexp(values, scales.astype(np.int32)[:, None] - 127, out=values)

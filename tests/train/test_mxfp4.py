"""MXFP4's decoding (`zoo.engine.weights.dequantize_mxfp4`) against values computed by hand: every
FP4 code, the nibbles' order, the scales' exponent bias of 127 and its extremes, the layout of
the decoded experts, and the shapes it refuses."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from zoo.engine.weights import dequantize_mxfp4, mxfp4_shape

FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
"""E2M1 by hand: code 0b0001 is the subnormal 0.5, 0b0111 is 1.5 x 2^2, bit 3 the sign."""


def one_group(codes: list[int], scale: int) -> tuple[np.ndarray, np.ndarray]:
    """Blocks [1 expert, 1 row, 1 group, 16 bytes] holding the 32 `codes` in order (the earlier
    of each pair in the low nibble), and its scale byte."""
    pairs = np.asarray(codes, np.uint8).reshape(16, 2)
    blocks = (pairs[:, 0] | pairs[:, 1] << 4).reshape(1, 1, 1, 16)
    return blocks, np.full((1, 1, 1), scale, np.uint8)


def decoded_row(codes: list[int], scale: int, dtype=np.float32) -> np.ndarray:
    blocks, scales = one_group(codes, scale)
    out = dequantize_mxfp4(blocks, scales, dtype=dtype)
    assert out.shape == (1, 32, 1) and out.dtype == dtype
    return out[0, :, 0]


def test_every_fp4_code_at_scale_one():
    codes = list(range(16)) * 2
    row = decoded_row(codes, 127)
    np.testing.assert_array_equal(row, FP4 * 2)
    assert np.signbit(row[8]) and not np.signbit(row[0])  # -0.0 stays negative


def test_the_low_nibble_is_the_earlier_value():
    blocks = np.zeros((1, 1, 1, 16), np.uint8)
    blocks[..., 0] = 0x72  # low nibble 2 (1.0), high nibble 7 (6.0)
    out = dequantize_mxfp4(blocks, np.full((1, 1, 1), 127, np.uint8))[0, :, 0]
    assert out[:3].tolist() == [1.0, 6.0, 0.0]


@pytest.mark.parametrize(
    ("scale", "one", "six", "minus_half"),
    [
        (127, 1.0, 6.0, -0.5),
        (128, 2.0, 12.0, -1.0),
        (120, 2.0**-7, 6 * 2.0**-7, -(2.0**-8)),
        (1, 2.0**-126, 6 * 2.0**-126, -(2.0**-127)),  # the smallest normal power
        (0, 2.0**-127, 6 * 2.0**-127, -(2.0**-128)),  # subnormal in float32, exact still
        (254, 2.0**127, np.inf, -(2.0**126)),  # 6 x 2^127 is past float32's range
        (255, np.inf, np.inf, -(2.0**127)),  # 2^128 x 1 is too; 2^128 x 0.5 is not
    ],
)
def test_the_scale_is_two_to_the_byte_minus_127(scale, one, six, minus_half):
    """Codes 2 (1.0), 7 (6.0), 0 (0.0) and 9 (-0.5), each times 2^(scale - 127), exactly."""
    row = decoded_row([2, 7, 0, 9] + [0] * 28, scale)
    assert row[:4].astype(np.float64).tolist() == [one, six, 0.0, minus_half]
    assert not np.signbit(row[2])  # zero stays zero at every scale, 255 included


def test_the_smallest_value_is_exact_in_bfloat16():
    """0.5 x 2^-127 = 2^-128, a bfloat16 subnormal: decoding to bfloat16 rounds nothing."""
    row = decoded_row([1, 15, 7] + [0] * 29, 0, dtype=ml_dtypes.bfloat16)
    assert row[:3].astype(np.float64).tolist() == [2.0**-128, -6 * 2.0**-127, 6 * 2.0**-127]


def test_the_experts_are_decoded_inputs_first():
    """Blocks [experts, rows, groups, 16] decode to [experts, groups x 32, rows]: row r's
    groups end to end down column r, each group with its own scale."""
    experts, rows, groups = 2, 3, 2
    codes = np.arange(experts * rows * groups * 32).reshape(experts, rows, groups, 32) % 8
    blocks = (codes[..., 0::2] | codes[..., 1::2] << 4).astype(np.uint8)
    scales = 127 + np.arange(experts * rows * groups, dtype=np.uint8).reshape(experts, rows, groups)
    out = dequantize_mxfp4(blocks, scales)
    assert out.shape == (experts, groups * 32, rows)
    for e, r, g, i in [(0, 0, 0, 0), (0, 2, 1, 31), (1, 1, 0, 5), (1, 2, 1, 17)]:
        expected = FP4[codes[e, r, g, i]] * 2.0 ** (int(scales[e, r, g]) - 127)
        assert out[e, g * 32 + i, r] == expected


@pytest.mark.parametrize(
    ("blocks", "scales", "named"),
    [
        (((2, 4, 3, 16), np.uint8), ((2, 4, 2), np.uint8), r"\[2, 4, 3, 16\].*\[2, 4, 2\]"),
        (((4, 3, 16), np.uint8), ((4, 3), np.uint8), r"\[4, 3, 16\]"),
        (((2, 4, 3, 16), np.float32), ((2, 4, 3), np.uint8), "float32"),
    ],
)
def test_shapes_and_dtypes_that_do_not_fit_are_refused(blocks, scales, named):
    with pytest.raises(ValueError, match=named):
        mxfp4_shape(blocks, scales)


def test_the_decoded_shape_is_stated_before_decoding():
    assert mxfp4_shape(((32, 5760, 90, 16), np.uint8), ((32, 5760, 90), np.uint8)) == (
        32,
        2880,
        5760,
    )

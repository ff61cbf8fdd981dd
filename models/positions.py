"""Learned position embeddings resized to another grid, as torch resizes them: a checkpoint's
positions for 14x14 patches serve 16x16 patches of larger images.

Torch's bicubic resize is separable, so each axis is one matrix (new length x old length),
built here in numpy from torch's own formulas and applied as two contractions:
- `bicubic`: `F.interpolate(mode="bicubic", align_corners=False)`, Keys' cubic with a = -0.75
  and edge pixels repeated (Hugging Face's `interpolate_pos_encoding`);
- `bicubic_antialias`: the same call with `antialias=True` (timm's `resample_abs_pos_embed`),
  Pillow's cubic with a = -0.5, its support widened by the factor when shrinking, each row's
  weights normalised to sum to one.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

MODES = ("bicubic", "bicubic_antialias")


def _keys_cubic(x: np.ndarray, a: float) -> np.ndarray:
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x <= 1, near, np.where(x < 2, far, 0.0))


def _bicubic(old: int, new: int) -> np.ndarray:
    scale, matrix = old / new, np.zeros((new, old))
    for i in range(new):
        source = (i + 0.5) * scale - 0.5
        floor = math.floor(source)
        for tap in range(-1, 3):
            index = min(max(floor + tap, 0), old - 1)
            matrix[i, index] += _keys_cubic(np.array(source - (floor + tap)), -0.75)
    return matrix


def _bicubic_antialias(old: int, new: int) -> np.ndarray:
    scale, matrix = old / new, np.zeros((new, old))
    support, inverse = 2 * max(scale, 1.0), 1 / max(scale, 1.0)
    for i in range(new):
        center = scale * (i + 0.5)
        low = max(int(center - support + 0.5), 0)
        high = min(int(center + support + 0.5), old)
        taps = np.arange(low, high)
        weights = _keys_cubic((taps - center + 0.5) * inverse, -0.5)
        matrix[i, low:high] = weights / weights.sum()
    return matrix


def resize_matrix(old: int, new: int, mode: str) -> np.ndarray:
    """(new, old) float32: row i weighs the old positions that new position i draws on."""
    build = _bicubic if mode == "bicubic" else _bicubic_antialias
    return build(old, new).astype(np.float32)


def resize(grid: jax.Array, new: tuple[int, int], mode: str) -> jax.Array:
    """`grid` (height x width x features) resized to `new` (height, width)."""
    (old_h, old_w), (new_h, new_w) = grid.shape[:2], new
    if (old_h, old_w) == (new_h, new_w):
        return grid
    rows = jnp.asarray(resize_matrix(old_h, new_h, mode))
    columns = jnp.asarray(resize_matrix(old_w, new_w, mode))
    return jnp.einsum("ih,jw,hwd->ijd", rows, columns, grid)

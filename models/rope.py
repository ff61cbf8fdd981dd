"""Rotary position embeddings (RoPE) and the scalings of their frequencies that checkpoints use.

A head's features are rotated in pairs by angles `position * inverse frequency`, so that the
product of a query and a key depends on their distance alone. The pairs are the two halves of
the head (feature i with feature i + head_dim / 2: Hugging Face's `rotate_half` layout), not
neighbours, so a Llama, Qwen, Mistral or Gemma checkpoint's projections are used as they are.

The inverse frequencies are constants of the model, computed in float32 with the operations of
transformers' `modeling_rope_utils` so that a checkpoint's angles come out the same:
- `default`: `1 / theta ** (2i / head_dim)`;
- `linear`: the default divided by `factor` (positions stretched `factor` times);
- `llama3`: Llama 3.1's: wavelengths longer than `original_context / low_freq_factor` divided by
  `factor`, shorter than `original_context / high_freq_factor` kept, those between interpolated.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "llama3")

Rotation = tuple[jax.Array, jax.Array]
"""The cosines and sines of every position's angles: two arrays of length x head_dim."""


@dataclasses.dataclass(frozen=True)
class Rope:
    """The frequencies of one kind of layer: base `theta`, scaling `kind` and its parameters."""

    theta: float
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192


@functools.cache
def inverse_frequencies(rope: Rope, head_dim: int) -> np.ndarray:
    """The head_dim / 2 inverse frequencies (float32) that positions are multiplied by."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / (np.float32(rope.theta) ** exponents)
    if rope.kind == "linear":
        return inv_freq / np.float32(rope.factor)
    if rope.kind == "llama3":
        return _llama3(inv_freq, rope)
    return inv_freq


def _llama3(inv_freq: np.ndarray, rope: Rope) -> np.ndarray:
    low, high, factor = rope.low_freq_factor, rope.high_freq_factor, np.float32(rope.factor)
    context = rope.original_context
    wavelength = np.float32(2 * math.pi) / inv_freq
    long_waves = wavelength > context / low
    scaled = np.where(long_waves, inv_freq / factor, inv_freq)
    smooth = (np.float32(context) / wavelength - np.float32(low)) / np.float32(high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelength < context / high) & ~long_waves
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rotation(
    rope: Rope, head_dim: int, positions: jax.Array | np.ndarray, dtype: jnp.dtype
) -> Rotation:
    """Cosines and sines (in `dtype`) of the angles at `positions` (integers: length, or
    batch x length for rows of their own positions): computed in float32, then rounded to the
    dtype the heads are in, as transformers does.

    Positions known when the step is traced (a numpy array: a training row's 0, 1, ...) give
    tables computed then, by the same XLA operations, which the compiled step holds as
    constants: traced, XLA:CPU fuses the cosines and sines into every op that reads them (each
    rotation, each of attention's blocks, their gradients) and computes them again in each."""
    if isinstance(positions, np.ndarray):
        with jax.ensure_compile_time_eval():
            return rotation(rope, head_dim, jnp.asarray(positions), dtype)
    inv_freq = jnp.asarray(inverse_frequencies(rope, head_dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def rotate(x: jax.Array, angles: Rotation) -> jax.Array:
    """Heads `x` (batch x length x heads x head_dim) rotated by `angles` ([batch x] length x
    head_dim)."""
    cos, sin = (a[:, :, None, :] if a.ndim == 3 else a[None, :, None, :] for a in angles)
    half = x.shape[-1] // 2
    rotated_half = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated_half * sin

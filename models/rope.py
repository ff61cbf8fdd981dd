"""Rotary position embeddings (RoPE) and the scalings of their frequencies that checkpoints use.

A head's features are rotated in pairs by angles `position * inverse frequency`, so that the
product of a query and a key depends on their distance alone. The pairs are the two halves of
the head (feature i with feature i + head_dim / 2: Hugging Face's `rotate_half` layout), not
neighbours, so a Llama, Qwen, Mistral or Gemma checkpoint's projections are used as they are;
DeepSeek V3's `rope_interleave` pairs neighbours (`rotate_interleaved`).

The inverse frequencies are constants of the model, computed in float32 with the operations of
transformers' `modeling_rope_utils` so that a checkpoint's angles come out the same:
- `default`: `1 / theta ** (2i / head_dim)`;
- `linear`: the default divided by `factor` (positions stretched `factor` times);
- `llama3`: Llama 3.1's: wavelengths longer than `original_context / low_freq_factor` divided by
  `factor`, shorter than `original_context / high_freq_factor` kept, those between interpolated;
- `yarn` (YaRN, gpt-oss): the frequencies that turn fewer than `beta_slow` times over
  `original_context` positions divided by `factor`, those that turn more than `beta_fast` times
  kept, a linear ramp between them (its ends rounded outwards with `truncate`); and the cosines
  and sines multiplied by an attention factor (`attention_factor`, or 0.1 ln(factor) + 1),
  which scales every attention logit by its square.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

ROPE_TYPES = ("default", "linear", "llama3", "yarn")

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
    beta_fast: float = 32.0  # `yarn`: rotations above which a frequency is kept
    beta_slow: float = 1.0  # `yarn`: rotations below which it is divided by `factor`
    truncate: bool = True  # `yarn`: the ramp's ends rounded to whole features
    attention_factor: float = 0.0  # `yarn`: the cosines' and sines' factor; 0: from `factor`

    @property
    def scaling(self) -> float:
        """The factor of the cosines and sines: YaRN's attention factor (transformers'
        `_compute_yarn_parameters`), 1 for the other kinds."""
        if self.kind != "yarn":
            return 1.0
        if self.attention_factor:
            return self.attention_factor
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0


@functools.cache
def inverse_frequencies(rope: Rope, head_dim: int) -> np.ndarray:
    """The head_dim / 2 inverse frequencies (float32) that positions are multiplied by."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / (np.float32(rope.theta) ** exponents)
    if rope.kind == "linear":
        return inv_freq / np.float32(rope.factor)
    if rope.kind == "llama3":
        return _llama3(inv_freq, rope)
    if rope.kind == "yarn":
        return _yarn(np.float32(rope.theta) ** exponents, rope, head_dim)
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


def _yarn(powers: np.ndarray, rope: Rope, head_dim: int) -> np.ndarray:
    """YaRN's frequencies from `powers` (theta ** (2i / head_dim)), in float32 with the
    operations of transformers' `_compute_yarn_parameters`: the ramp's ends are the features
    whose frequencies turn `beta_fast` and `beta_slow` times over `original_context`."""
    extrapolated = np.float32(1.0) / powers
    interpolated = np.float32(1.0) / (np.float32(rope.factor) * powers)

    def feature(rotations: float) -> float:
        turns = math.log(rope.original_context / (rotations * 2 * math.pi))
        return head_dim * turns / (2 * math.log(rope.theta))

    low, high = feature(rope.beta_fast), feature(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers does, against a zero-width ramp
    ramp = (np.arange(head_dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
    kept = np.float32(1.0) - np.clip(ramp, np.float32(0.0), np.float32(1.0))
    return (interpolated * (np.float32(1.0) - kept) + extrapolated * kept).astype(np.float32)


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
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if rope.scaling != 1.0:  # YaRN: in float32, before the rounding, as transformers does
        cos, sin = cos * np.float32(rope.scaling), sin * np.float32(rope.scaling)
    return cos.astype(dtype), sin.astype(dtype)


def rotate(x: jax.Array, angles: Rotation) -> jax.Array:
    """Heads `x` (batch x length x heads x head_dim) rotated by `angles` ([batch x] length x
    head_dim)."""
    cos, sin = _per_head(angles)
    half = x.shape[-1] // 2
    rotated_half = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated_half * sin


def rotate_interleaved(x: jax.Array, angles: Rotation) -> jax.Array:
    """Heads `x` rotated as `rotate` does, but in pairs of neighbouring features (0, 1),
    (2, 3), ..., the rotated first features of the pairs then the second (the halves layout):
    DeepSeek V3's `rope_interleave`, in the operations of transformers'
    `apply_rotary_pos_emb_interleave`."""
    cos, sin = (a[..., : a.shape[-1] // 2] for a in _per_head(angles))
    first, second = x[..., 0::2], x[..., 1::2]
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def _per_head(angles: Rotation) -> Rotation:
    """`angles` broadcast over the heads (and the batch, where they are a row's own)."""
    cos, sin = (a[:, :, None, :] if a.ndim == 3 else a[None, :, None, :] for a in angles)
    return cos, sin


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's magnitude factor of a scaling `factor` (1 where it does not stretch), as
    transformers' `get_mscale` and DeepSeek's `yarn_get_mscale` compute it."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

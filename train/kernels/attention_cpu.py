"""Attention as XLA:CPU runs it fastest: written out with the heads leading, and a causal
product computed in blocks of queries, each against the keys up to its own last position.

`jax.nn.dot_product_attention(implementation="xla")` maps its einsums over the query heads of
a key/value head (`vmap`) and takes them in the (batch, length, heads, features) layout it is
given; on a CPU the compiled step then spends most of its attention time transposing and
scaling batch x heads x length x length arrays, and computes the whole square of logits of a
causal product, the masked half included. Written out here, the queries, keys and values are
transposed once to (batch, heads, length, features), so that every batched matmul has its
batch dimensions leading; the logits' scale and mask fuse into the softmax; and the queries of
a causal product are taken in up to `MAX_BLOCKS` blocks of at least `MIN_BLOCK` positions,
block i against keys 0 ... its last position only, which skips up to 3/8 of the square.

The result is the same attention up to float rounding (the softmax of a block's row sums
fewer, exactly zero terms); measured at batch 8, context 256, 4 heads of 64 on a 2-core CPU,
forward and backward take a third of the time of `jax.nn.dot_product_attention`'s (see
docs/performance.md).

A decoding step's attention (`attend_one`, one query a row against the key/value cache) is
written as sums of products instead, reading the cache as it is held. Which calls take either is
`zoo.engine.kernels.attention`'s choice.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

MIN_BLOCK = 64
"""The fewest queries in a block: smaller matmuls lose more to overhead than they skip."""
MAX_BLOCKS = 4
"""The most blocks a causal product is split into (each a few more ops to compile)."""
_NO_ATTENTION = -1e30  # a logit that softmax turns into exactly zero weight
_ALGORITHMS = {
    jnp.dtype(jnp.bfloat16): jax.lax.DotAlgorithmPreset.BF16_BF16_F32,
    jnp.dtype(jnp.float16): jax.lax.DotAlgorithmPreset.F16_F16_F32,
}
"""The logits' algorithm for half-precision queries and keys, as jax's kernel asks for it: the
backward pass then multiplies the logits' float32 cotangent rounded to the inputs' precision,
not in float32."""


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float | None,
    causal: bool,
    segments: jax.Array | None = None,
) -> jax.Array:
    """softmax(q.k * scale) . v over (batch, length, heads, features) queries, keys and values
    of one length, each query seeing every key or (`causal`) itself and earlier ones, and with
    `segments` (batch x length: each position's sequence in a packed row) only those of its
    own sequence; `scale` None: 1/sqrt(features). Logits and softmax in float32, as jax's
    kernel computes them (bfloat16 and float16 inputs multiplied as such, see `_ALGORITHMS`)."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    q, k, v = (jnp.swapaxes(t, 1, 2) for t in (q, k, v))  # batch, heads, length, features
    length = q.shape[2]
    blocks = min(MAX_BLOCKS, max(1, length // MIN_BLOCK)) if causal else 1
    size = -(-length // blocks)
    mixed = [
        _block(q[:, :, start : start + size], k, v, start, scale, causal, segments)
        for start in range(0, length, size)
    ]
    return jnp.swapaxes(jnp.concatenate(mixed, axis=2) if len(mixed) > 1 else mixed[0], 1, 2)


def _block(q, k, v, start: int, scale: float, causal: bool, segments) -> jax.Array:
    """The queries at positions start, start + 1, ... against the keys they may see."""
    end = start + q.shape[2] if causal else k.shape[2]
    k, v = k[:, :, :end], v[:, :, :end]
    logits = jnp.einsum(
        "bhqd,bhkd->bhqk",
        q,
        k,
        precision=_ALGORITHMS.get(jnp.dtype(q.dtype)),
        preferred_element_type=jnp.float32,
    )
    logits = logits * scale
    visible = None
    if causal:
        visible = jnp.arange(end)[None, :] <= (start + jnp.arange(q.shape[2]))[:, None]
    if segments is not None:
        queries = segments[:, start : start + q.shape[2]]
        same = (queries[:, :, None] == segments[:, None, :end])[:, None]
        visible = same if visible is None else same & visible
    if visible is not None:
        logits = jnp.where(visible, logits, _NO_ATTENTION)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bhkd->bhqd", weights, v)


def attend_one(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    visible: jax.Array,
    *,
    scale: float,
    softcap: float = 0.0,
) -> jax.Array:
    """A decoding step's attention: one query a row (q: batch, 1, heads, features) to the
    cache's keys and values (batch, slots, key/value heads, features; grouped-query heads
    share them), `visible` (batch, 1, 1, slots) the slots each row sees; logits soft-capped by
    `softcap` (0: none). Written as products summed in one pass over the keys and one over the
    values, each read as the cache holds it: as batched matmuls, XLA:CPU would first copy both
    transposed (the heads leading) and, in bfloat16, widened to float32, which for one query
    costs more than the products. Logits, softmax and sums in float32."""
    if not jax.sharding.get_abstract_mesh().empty:  # one device: its named axes dropped
        q, k, v, visible = (jax.sharding.reshard(t, P()) for t in (q, k, v, visible))
    batch, _, heads, features = q.shape
    groups = heads // k.shape[2]
    q = q.reshape(batch, 1, k.shape[2], groups, features).astype(jnp.float32)
    logits = jnp.sum(q * k[:, :, :, None, :].astype(jnp.float32), axis=-1) * scale
    if softcap:
        logits = softcap * jnp.tanh(logits / softcap)
    seen = visible.reshape(batch, -1)[:, :, None, None]  # batch, slots, 1, 1
    weights = jax.nn.softmax(jnp.where(seen, logits, _NO_ATTENTION), axis=1)
    mixed = jnp.sum(weights[..., None] * v[:, :, :, None, :].astype(jnp.float32), axis=1)
    return mixed.reshape(batch, 1, heads, features).astype(v.dtype)

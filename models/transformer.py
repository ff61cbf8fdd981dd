"""The transformer block that `vit` and `gpt` share: pre-norm multi-head self-attention and a
GELU MLP, each added back to its input.

What pretrained checkpoints differ in is an option (`BlockOptions`): biases on the attention
projections, the LayerNorm epsilon, exact or tanh-approximated GELU, the MLP's width, the
factor of the attention logits.

Attention's projections are written out rather than taken from `nnx.MultiHeadAttention`, so
each contraction can say where its output lives: heads are split over the `tensor` mesh axis,
and explicit sharding needs the output projection's sum over heads placed explicitly. A causal
block (`gpt`) masks later positions and can run a few new tokens against a fixed-size key/value
cache. Between the projections, `zoo.models.attention_route` picks how the attention itself runs:
- fused, `jax.nn.dot_product_attention` with cuDNN's flash attention: on an NVIDIA GPU from
  Ampere on, in bfloat16 or float16 (`trainer.precision=bf16`), heads of a multiple of 8 up to
  128 (256 from Hopper on), without a cache; a causal mask is cuDNN's own (`is_causal`);
- fused with XLA's kernel: everywhere else without attention Dropout in training: CPUs, TPUs,
  float32, decoding against the cache (with a mask of positions); on a CPU, without a cache,
  zoo's own written-out attention, which XLA:CPU runs three times faster
  (`zoo.models.attention_cpu`);
- written out in two einsums: where Dropout on the attention weights is on in training, on
  every platform. `vit` trains so by default (its `dropout_rate`, 0.1, is also its attention
  Dropout); its evals and `gpt` (no attention Dropout) take a fused path.

Randomness comes at call time as one key per block, split into one key per Dropout site, so a
stack of blocks can be scanned over (the keys are a scanned input).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from zoo.models import attention_cpu, kv_cache
from zoo.models.attention_route import current_platform, dot_product_attention, route
from zoo.models.kv_cache import KVCache, Slots
from zoo.models.layers import dense, head_projections, layer_norm

from zoo.plugin import ZooError, logical_spec

_NO_ATTENTION = -1e30  # a logit that softmax turns into exactly zero weight


@dataclasses.dataclass(frozen=True)
class BlockOptions:
    """How a block differs between model families: `attention_bias` on the query, key, value
    and output projections; `norm_epsilon` of both LayerNorms; `exact_gelu` (erf) instead of
    the tanh approximation; an MLP `mlp_ratio` times as wide as the features (a float allowed:
    the width is rounded down); `attention_scale`: the factor of the attention logits (None:
    1/sqrt(head size))."""

    mlp_ratio: float = 4
    attention_bias: bool = False
    norm_epsilon: float = 1e-6
    exact_gelu: bool = False
    attention_scale: float | None = None


def tokens_spec():
    """Where a batch x length x features activation lives: split along the batch only."""
    return logical_spec("batch", None, None)


class Attention(nnx.Module):
    """Multi-head self-attention; `causal`: each position sees itself and earlier ones only.
    Dropout on the attention weights at `dropout_rate`. The logits are q.k times `scale`
    (None: 1/sqrt(head size))."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        dropout_rate: float,
        causal: bool,
        rngs: nnx.Rngs,
        use_bias: bool = False,
        scale: float | None = None,
    ):
        self.query, self.key, self.value, self.out = head_projections(
            dim, num_heads, rngs=rngs, use_bias=use_bias
        )
        self.dropout = nnx.Dropout(dropout_rate)
        self.causal, self.scale = causal, scale

    def __call__(
        self,
        x: jax.Array,
        key: jax.Array,
        cache: KVCache | None,
        slots: Slots | None,
        query_scale: jax.Array | float | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """Attention of the tokens to each other without a cache; with one, of the tokens at
        `slots` to the cache's, after writing their own keys and values into it
        (`zoo.models.kv_cache`). `key`: the attention weights' Dropout masks. `query_scale`: a
        factor of the queries, which a layer of a stack may be given as a traced value (where
        `scale` is the same for every layer)."""
        heads = logical_spec("batch", None, "heads", None)
        q, k, v = (proj(x, out_sharding=heads) for proj in (self.query, self.key, self.value))
        if query_scale is not None:
            q = q * jnp.asarray(query_scale, q.dtype)
        if cache is None:
            mixed = self._attend(q, k, v, None, key, cached=False)
        else:
            k, v, visible, cache = kv_cache.update(cache, k, v, slots, 0)
            visible = visible[:, None]  # the same for every head

            def attend(k, v, visible):
                return self._attend(q, k, v, visible, key, cached=True)

            mixed = kv_cache.over_written_slots(attend, k, v, visible, slots, 0)
        return self.out(mixed, out_sharding=tokens_spec()), cache

    def _attend(self, q, k, v, visible, key, cached: bool) -> jax.Array:
        dropout = bool(self.dropout.rate) and not self.dropout.deterministic
        path = route(
            current_platform(),
            q.dtype,
            q.shape[-1],
            causal=self.causal,
            cached=cached,
            dropout=dropout,
        )
        if path.mask == "positions" and visible is None:
            visible = jnp.tril(jnp.ones((1, 1, q.shape[1], k.shape[1]), bool))
        if path.kernel == "einsum":
            return self._with_dropout(q, k, v, visible, key)
        if attention_cpu.one_query(q, k, visible):
            scale = 1 / math.sqrt(q.shape[-1]) if self.scale is None else self.scale
            return attention_cpu.attend_one(q, k, v, visible, scale=scale)
        if path.kernel == "xla" and visible is None and current_platform().backend == "cpu":
            return attention_cpu.attend(q, k, v, scale=self.scale, causal=path.mask == "causal")
        return dot_product_attention(
            q,
            k,
            v,
            mask=visible,
            scale=self.scale,
            is_causal=path.mask == "causal",
            implementation=path.kernel,
        )

    def _with_dropout(self, q, k, v, visible, key) -> jax.Array:
        """Attention written out, for Dropout on its weights (which the fused call lacks)."""
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        logits = logits / math.sqrt(q.shape[-1]) if self.scale is None else logits * self.scale
        if visible is not None:
            logits = jnp.where(visible, logits, _NO_ATTENTION)
        weights = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(v.dtype)
        return jnp.einsum("bhqk,bkhd->bqhd", self.dropout(weights, rngs=key), v)


class Block(nnx.Module):
    """x + attention(norm(x)), then x + mlp(norm(x)): pre-norm, which trains stably without
    warm-up tricks at small sizes. Dropout on each branch's output at `dropout_rate`, and on the
    attention weights at `attention_dropout`; none on the wider MLP hidden layer (random bits
    cost about 25 ns each on a CPU: a dropout there would add half again to a small step)."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float,
        dropout_rate: float,
        *,
        attention_dropout: float = 0.0,
        causal: bool = False,
        options: BlockOptions = BlockOptions(),
        rngs: nnx.Rngs,
    ):
        epsilon, hidden = options.norm_epsilon, int(dim * mlp_ratio)
        self.attention_norm = layer_norm(dim, rngs=rngs, epsilon=epsilon)
        self.attention = Attention(
            dim,
            num_heads,
            dropout_rate=attention_dropout,
            causal=causal,
            rngs=rngs,
            use_bias=options.attention_bias,
            scale=options.attention_scale,
        )
        self.mlp_norm = layer_norm(dim, rngs=rngs, epsilon=epsilon)
        self.mlp_in = dense(dim, hidden, ("embed", "mlp"), rngs=rngs)
        self.mlp_out = dense(hidden, dim, ("mlp", "embed"), rngs=rngs)
        self.dropout = nnx.Dropout(dropout_rate)
        self.exact_gelu = options.exact_gelu

    def __call__(
        self,
        x: jax.Array,
        key: jax.Array,
        cache: KVCache | None = None,
        slots: Slots | None = None,
        query_scale: jax.Array | float | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        attention_key, mlp_key, weights_key = jax.random.split(key, 3)
        normed = self.attention_norm(x)
        h, cache = self.attention(normed, weights_key, cache, slots, query_scale)
        x = x + self.dropout(h, rngs=attention_key)
        h = self.mlp_in(self.mlp_norm(x), out_sharding=logical_spec("batch", None, "mlp"))
        h = nnx.gelu(h, approximate=not self.exact_gelu)
        h = self.mlp_out(h, out_sharding=tokens_spec())
        return x + self.dropout(h, rngs=mlp_key), cache


def dropout_key(rngs: nnx.Rngs | None, rate: float, deterministic: bool, model: str) -> jax.Array:
    """The key a stack of blocks draws its Dropout masks from: a fresh one from the call-time
    `rngs`; without them, a constant that is never used (eval mode, or rate 0)."""
    if rngs is not None:
        return rngs.dropout()
    if rate > 0 and not deterministic:
        raise ZooError(
            f"{model} in train mode with dropout needs call-time rngs: model(x, rngs=rngs)."
        )
    return jax.random.key(0)

"""The transformer block that `vit` and `gpt` share: pre-norm multi-head self-attention and a
GELU MLP, each added back to its input.

What pretrained checkpoints differ in is an option (`BlockOptions`): biases on the attention
projections, the LayerNorm epsilon, exact or tanh-approximated GELU, the MLP's width, the
factor of the attention logits.

Attention's projections are written out rather than taken from `nnx.MultiHeadAttention`, so
each contraction can say where its output lives: heads are split over the `tensor` mesh axis,
and explicit sharding needs the output projection's sum over heads placed explicitly. A causal
block (`gpt`) masks later positions and can run a few new tokens against a fixed-size key/value
cache. Between the projections, attention itself is `zoo.plugin.attend`'s (`attend_tokens`, the
one call of `gpt`, `vit` and `decoder`), which picks the kernel for the platform: cuDNN's flash
attention, XLA's, zoo's CPU kernels, or written out where Dropout is on its weights (`vit`
trains so by default: its `dropout_rate`, 0.1, is also its attention Dropout).

Randomness comes at call time as one key per block, split into one key per Dropout site, so a
stack of blocks can be scanned over (the keys are a scanned input).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from zoo.models import kv_cache
from zoo.models.kv_cache import KVCache, Slots
from zoo.models.layers import dense, head_projections, layer_norm

from zoo.plugin import ZooError, attend, logical_spec


@dataclasses.dataclass(frozen=True)
class BlockOptions:
    """How a block differs between model families: `attention_bias` on the query, key, value
    and output projections; `norm_epsilon` of both LayerNorms; `exact_gelu` (erf) instead of
    the tanh approximation; an MLP `mlp_ratio` times as wide as the features (a float allowed:
    the width is rounded down), or `mlp_dim` wide where that is not 0 (a checkpoint's width that
    is no whole multiple, such as SigLIP's 4304 of 1152); `attention_scale`: the factor of the
    attention logits (None: 1/sqrt(head size))."""

    mlp_ratio: float = 4
    attention_bias: bool = False
    norm_epsilon: float = 1e-6
    exact_gelu: bool = False
    attention_scale: float | None = None
    mlp_dim: int = 0


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
        mask: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """Attention of the tokens to each other without a cache; with one, of the tokens at
        `slots` to the cache's, after writing their own keys and values into it
        (`zoo.models.kv_cache`). `key`: the attention weights' Dropout masks. `query_scale`: a
        factor of the queries, which a layer of a stack may be given as a traced value (where
        `scale` is the same for every layer). `mask` (batch, 1, queries, keys), without a
        cache: the keys each query sees (SigLIP's text tower hides padding keys)."""
        heads = logical_spec("batch", None, "heads", None)
        q, k, v = (proj(x, out_sharding=heads) for proj in (self.query, self.key, self.value))
        if query_scale is not None:
            q = q * jnp.asarray(query_scale, q.dtype)
        dropping = bool(self.dropout.rate) and not self.dropout.deterministic
        dropout = functools.partial(self.dropout, rngs=key) if dropping else None
        masked = {} if mask is None else {"cache_mask": mask}
        mixed, cache = attend_tokens(
            q, k, v, cache, slots, scale=self.scale, causal=self.causal, dropout=dropout, **masked
        )
        return self.out(mixed, out_sharding=tokens_spec()), cache


def attend_tokens(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cache: KVCache | None,
    slots: Slots | None,
    *,
    window: int = 0,
    **options,
) -> tuple[jax.Array, KVCache | None]:
    """`attend` (`zoo.plugin`, with `window` and `options`) of the new tokens' queries to their
    keys and values; with a cache, to the cache's, after writing theirs into it at `slots`
    (`zoo.models.kv_cache`), and the cache back with them in it."""
    if cache is None:
        return attend(q, k, v, window=window, **options), None
    k, v, visible, cache = kv_cache.update(cache, k, v, slots, window)

    def to_slots(k, v, visible):
        return attend(q, k, v, window=window, cache_mask=visible, **options)

    visible = visible[:, None]  # the same for every head
    return kv_cache.over_written_slots(to_slots, k, v, visible, slots, window), cache


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
        epsilon, hidden = options.norm_epsilon, options.mlp_dim or int(dim * mlp_ratio)
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
        mask: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        attention_key, mlp_key, weights_key = jax.random.split(key, 3)
        normed = self.attention_norm(x)
        h, cache = self.attention(normed, weights_key, cache, slots, query_scale, mask)
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

"""The parts of `decoder`'s layer: RMSNorm, grouped-query attention with rotary positions and
an optional sliding window, a gated MLP, and the layer that composes them.

Every param is created in the model's param dtype (float32, or bfloat16 to hold a checkpoint
as it is stored) and the layers compute in it; RMSNorm's statistics and the attention softmax
are float32 whatever it is. Params carry logical axes: query heads on `heads`, key and value
heads on `kv_heads` (which the rules may leave unsplit when the key/value heads are too few to
divide among the devices: the activations follow the params, see `kv_heads_spec`).

How the layer is wired follows the checkpoints it loads: Llama, Mistral and Qwen are
x + attention(norm(x)), then x + mlp(norm(x)); Gemma adds a norm after each branch
(`post_norms`) and scales its norms by 1 + w (`unit_offset`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from zoo.models import kv_cache
from zoo.models.experts import ExpertOptions, MixtureOfExperts
from zoo.models.kv_cache import KVCache, Slots
from zoo.models.rope import Rotation, rotate, rotate_interleaved
from zoo.models.transformer import attend_tokens, tokens_spec

from zoo.plugin import TransposedLinear, attend, logical_spec, partitioned

ACTIVATIONS = {
    "silu": jax.nn.silu,  # SwiGLU (Llama, Mistral, Qwen)
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),  # GeGLU (Gemma's gelu_pytorch_tanh)
}
CLAMPED_SWIGLU = "clamped_swiglu"
"""gpt-oss's gate: (clip(up) + 1) * g * sigmoid(alpha * g), g the gate capped above (`Gated`)."""
ACTIVATION_NAMES = (*ACTIVATIONS, CLAMPED_SWIGLU)
FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)

_ZEROS, _ONES = nnx.initializers.zeros_init(), nnx.initializers.ones_init()
_FLOAT32 = jnp.dtype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class LayerOptions:
    """Everything a layer's structure and arithmetic depend on (the same for every layer; what
    differs between layers, full or sliding attention, comes at call time)."""

    dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    activation: str = "silu"
    norm_epsilon: float = 1e-6
    norm_unit_offset: bool = False
    post_norms: bool = False
    qk_norm: bool = False
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    attention_sinks: bool = False
    swiglu_limit: float = 7.0  # `clamped_swiglu` only
    swiglu_alpha: float = 1.702  # `clamped_swiglu` only
    query_scale: float = 0.0  # 0: head_dim
    attention_softcap: float = 0.0
    dropout_rate: float = 0.0
    dtype: jnp.dtype = _FLOAT32
    experts: ExpertOptions | None = None  # a mixture of experts in place of the MLP
    rope_interleaved: bool = False  # rotate neighbouring pairs of features (`rotate_interleaved`)
    # Multi-head latent attention (`LatentAttention`) when kv_lora_rank > 0.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: the queries in one projection
    rope_head_dim: int = 0  # the rotated features of each query and key head
    value_head_dim: int = 0
    logit_mscale: float = 1.0  # latent attention's logits also multiplied by its square

    @property
    def rotate(self) -> Callable[[jax.Array, Rotation], jax.Array]:
        """How queries and keys are rotated: by halves, or by neighbouring pairs."""
        return rotate_interleaved if self.rope_interleaved else rotate

    def norm(self, features: int, rngs: nnx.Rngs) -> RMSNorm:
        offset, dtype = self.norm_unit_offset, self.dtype
        return RMSNorm(features, self.norm_epsilon, unit_offset=offset, dtype=dtype, rngs=rngs)

    @property
    def gated(self) -> Gated:
        """How the MLP's (or each expert's) gate and up projections are joined."""
        return Gated(self.activation, self.swiglu_limit, self.swiglu_alpha)


@dataclasses.dataclass(frozen=True)
class Gated:
    """The join of a gated MLP's two projections: act(gate) * up (SwiGLU, GeGLU), or gpt-oss's
    clamped SwiGLU, which caps the gate at `limit` and the up projection at +-`limit` (so that
    no feature grows without bound) and computes (up + 1) * gate * sigmoid(`alpha` * gate), in
    the order of transformers' `GptOssExperts`. A value, not a function, so that layers built
    alike compare equal."""

    activation: str = "silu"
    limit: float = 7.0
    alpha: float = 1.702

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        if self.activation != CLAMPED_SWIGLU:
            return ACTIVATIONS[self.activation](gate) * up
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * self.alpha))


class RMSNorm(nnx.Module):
    """x / rms(x) times a learned scale, the statistics in float32. `unit_offset` (Gemma): the
    scale is 1 + w, w starting at zero and multiplied in float32 before rounding back; without
    it (Llama): the normalised x is rounded to its dtype first, then multiplied by w."""

    def __init__(
        self, features: int, epsilon: float, *, unit_offset: bool, dtype: jnp.dtype, rngs: nnx.Rngs
    ):
        init = partitioned(_ZEROS if unit_offset else _ONES, (None,))
        self.scale = nnx.Param(init(rngs.params(), (features,), dtype))
        self.epsilon, self.unit_offset = epsilon, unit_offset

    def __call__(self, x: jax.Array) -> jax.Array:
        wide = x.astype(jnp.float32)
        normed = wide * jax.lax.rsqrt(jnp.mean(wide * wide, axis=-1, keepdims=True) + self.epsilon)
        scale = self.scale[...]
        if self.unit_offset:
            return (normed * (1.0 + scale.astype(jnp.float32))).astype(x.dtype)
        return scale * normed.astype(x.dtype)


def _dense(features_in, features_out, axes: tuple, bias_axes: tuple, *, bias: bool, dtype, rngs):
    """A projection held as the checkpoints hold it: kernel (outputs..., inputs...), `axes` in
    that order (see `TransposedLinear`)."""
    return TransposedLinear(
        features_in,
        features_out,
        kernel_axes=axes,
        bias_axes=bias_axes,
        use_bias=bias,
        param_dtype=dtype,
        rngs=rngs,
    )


def kv_heads_spec(num_kv_heads: int, *names: str | None) -> P:
    """The spec of an activation with logical axes `names` (one of them `kv_heads`), with the
    key/value heads unsplit where the mesh axes that `kv_heads` maps to cannot divide them
    (as the params' are: multi-query attention on a tensor-parallel mesh)."""
    spec = logical_spec(*names)
    position = names.index("kv_heads")
    axes = spec[position]
    if axes is None:
        return spec
    mesh = jax.sharding.get_abstract_mesh()
    if num_kv_heads % math.prod(mesh.shape[a] for a in _as_tuple(axes)) == 0:
        return spec
    return P(*(None if i == position else entry for i, entry in enumerate(spec)))


class Attention(nnx.Module):
    """Causal self-attention with `num_kv_heads` key/value heads shared by groups of the
    `num_heads` query heads (grouped-query; 1: multi-query), rotary positions, and optional
    q/k/v and output biases, RMSNorm of each query and key head (`qk_norm`), logits scaled by
    `query_scale ** -0.5` and soft-capped (`attention_softcap`), and a learned sink per query
    head (`attention_sinks`, gpt-oss): a logit that joins each query's softmax without a value,
    so that a head may give less than all of its weight to the keys."""

    def __init__(self, options: LayerOptions, *, rngs: nnx.Rngs):
        o, dtype = options, options.dtype
        heads, kv = (o.num_heads, o.head_dim), (o.num_kv_heads, o.head_dim)

        def to_heads(shape, axis):
            axes, bias_axes = (axis, None, "embed"), (axis, None)
            return _dense(o.dim, shape, axes, bias_axes, bias=o.qkv_bias, dtype=dtype, rngs=rngs)

        self.query = to_heads(heads, "heads")
        self.key, self.value = to_heads(kv, "kv_heads"), to_heads(kv, "kv_heads")
        out_axes = ("embed", "heads", None)
        self.out = _dense(heads, o.dim, out_axes, (None,), bias=o.out_bias, dtype=dtype, rngs=rngs)
        self.query_norm = o.norm(o.head_dim, rngs) if o.qk_norm else None
        self.key_norm = o.norm(o.head_dim, rngs) if o.qk_norm else None
        self.sinks = _sinks(o, rngs) if o.attention_sinks else None
        self.num_kv_heads, self.softcap = o.num_kv_heads, o.attention_softcap
        self.scale = (o.query_scale or o.head_dim) ** -0.5
        self.rotate = o.rotate

    def __call__(
        self,
        x: jax.Array,
        angles: Rotation,
        window: int,
        cache: KVCache | None,
        slots: Slots | None,
        segments: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """Attention of the tokens to themselves and earlier ones (with a cache: of the tokens
        at `slots` to the cache's too, after writing theirs into it, `zoo.models.kv_cache`),
        each seeing the last `window` positions only, itself included (0: all of them), and
        with `segments` (batch x length, a packed row's sequence of each token) only those of
        its own sequence."""
        heads = logical_spec("batch", None, "heads", None)
        kv = kv_heads_spec(self.num_kv_heads, "batch", None, "kv_heads", None)
        q = self.query(x, out_sharding=heads)
        k, v = self.key(x, out_sharding=kv), self.value(x, out_sharding=kv)
        if self.query_norm is not None:
            q, k = self.query_norm(q), self.key_norm(k)
        q, k = self.rotate(q, angles), self.rotate(k, angles)
        mixed, cache = attend_tokens(
            q,
            k,
            v,
            cache,
            slots,
            window=window,
            scale=self.scale,
            causal=True,
            softcap=self.softcap,
            segments=segments,
            sinks=None if self.sinks is None else self.sinks[...],
        )
        return self.out(mixed, out_sharding=tokens_spec()), cache


class LatentAttention(nnx.Module):
    """Multi-head latent attention (DeepSeek V2 and V3, transformers' `DeepseekV3Attention`):
    each token's keys and values come from one compressed latent of `kv_lora_rank` features
    (RMS-normed) shared by every head, and a key of `rope_head_dim` rotated features shared
    the same way; the queries come from their own normed latent of `q_lora_rank` features (or
    from x directly, `q_lora_rank` 0). A query head's first head_dim - rope_head_dim features
    meet the key's unrotated ones, projected from the latent per head, its last the shared
    rotated key; a value head has `value_head_dim` features. The logits are scaled by
    head_dim ** -0.5 times `logit_mscale` squared (DeepSeek's YaRN mscale_all_dim).

    The key/value cache holds the latent and the rotated key, `kv_lora_rank + rope_head_dim`
    numbers a token and layer (DeepSeek V3: 576, where its 128 heads' keys and values would
    take 40960), and projects them to keys and values at each step, as transformers does.
    The latent norms' epsilon is transformers' 1e-6 whatever the model's (its
    `DeepseekV3RMSNorm` is built with the default there)."""

    def __init__(self, options: LayerOptions, *, rngs: nnx.Rngs):
        o, dtype = options, options.dtype
        heads, rank = o.num_heads, o.kv_lora_rank
        self.rank, self.nope = rank, o.head_dim - o.rope_head_dim
        self.value_head_dim = o.value_head_dim

        def down(features_in, features_out):
            axes = (None, "embed") if features_in == o.dim else (None, None)
            return _dense(
                features_in, features_out, axes, (None,), bias=False, dtype=dtype, rngs=rngs
            )

        def up(features_in, head_dim):
            axes = ("heads", None, "embed" if features_in == o.dim else None)
            shape = (heads, head_dim)
            return _dense(
                features_in, shape, axes, ("heads", None), bias=False, dtype=dtype, rngs=rngs
            )

        self.query_down = down(o.dim, o.q_lora_rank) if o.q_lora_rank else None
        self.query_down_norm = _latent_norm(o.q_lora_rank, o, rngs) if o.q_lora_rank else None
        self.query = up(o.q_lora_rank or o.dim, o.head_dim)
        self.kv_down = down(o.dim, rank + o.rope_head_dim)
        self.kv_norm = _latent_norm(rank, o, rngs)
        self.kv_up = up(rank, self.nope + o.value_head_dim)
        out_axes = ("embed", "heads", None)
        self.out = _dense(
            (heads, o.value_head_dim), o.dim, out_axes, (None,), bias=False, dtype=dtype, rngs=rngs
        )
        self.rotate = o.rotate
        self.scale = (o.query_scale or o.head_dim) ** -0.5 * o.logit_mscale * o.logit_mscale

    def __call__(
        self,
        x: jax.Array,
        angles: Rotation,
        window: int,
        cache: KVCache | None,
        slots: Slots | None,
        segments: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        """As `Attention`'s; with a cache, the new tokens' latents and rotated keys are written
        into it, and every visible slot's expanded to keys and values."""
        q = self._queries(x, angles)
        compressed = self.kv_down(x, out_sharding=logical_spec("batch", None, None))
        latent = self.kv_norm(compressed[..., : self.rank])[:, :, None, :]  # one head
        rotated = self.rotate(compressed[..., None, self.rank :], angles)

        def attend_to(latent, rotated, visible):
            k, v = self._keys_and_values(latent, rotated)
            return self._attend(q, k, v, window, segments, visible)

        if cache is None:
            mixed = attend_to(latent, rotated, None)
        else:
            latent, rotated, visible, cache = kv_cache.update(cache, latent, rotated, slots, window)
            visible = visible[:, None]  # the same for every head
            mixed = kv_cache.over_written_slots(attend_to, latent, rotated, visible, slots, window)
        return self.out(mixed, out_sharding=tokens_spec()), cache

    def _queries(self, x: jax.Array, angles: Rotation) -> jax.Array:
        heads = logical_spec("batch", None, "heads", None)
        if self.query_down is not None:
            x = self.query_down_norm(
                self.query_down(x, out_sharding=logical_spec("batch", None, None))
            )
        q = self.query(x, out_sharding=heads)
        return jnp.concatenate([q[..., : self.nope], self.rotate(q[..., self.nope :], angles)], -1)

    def _keys_and_values(
        self, latent: jax.Array, rotated: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """Every head's keys (the latent's projection, then the shared rotated key) and values
        of `latent` (batch, slots, 1, kv_lora_rank) and `rotated` (batch, slots, 1,
        rope_head_dim)."""
        heads = logical_spec("batch", None, "heads", None)
        kv = self.kv_up(latent[:, :, 0], out_sharding=heads)
        shared = jnp.broadcast_to(rotated, (*kv.shape[:-1], rotated.shape[-1]))
        shared = jax.sharding.reshard(shared, heads)
        k = jnp.concatenate([kv[..., : self.nope], shared], axis=-1)
        return k, kv[..., self.nope :]

    def _attend(self, q, k, v, window, segments, visible) -> jax.Array:
        """`attend` of queries and keys of head_dim features to values of value_head_dim: the
        narrower of the two padded with zeros to the wider (which adds nothing to a logit or
        an output feature), the output cut back to the values' width."""
        width = max(q.shape[-1], v.shape[-1])
        q, k, v = (_padded(t, width) for t in (q, k, v))
        mixed = attend(
            q,
            k,
            v,
            scale=self.scale,
            causal=True,
            window=window,
            segments=segments,
            cache_mask=visible,
        )
        return mixed[..., : self.value_head_dim]


def _latent_norm(features: int, o: LayerOptions, rngs: nnx.Rngs) -> RMSNorm:
    """A latent's RMSNorm, with transformers' epsilon for it (`LatentAttention`)."""
    return RMSNorm(features, LATENT_NORM_EPSILON, unit_offset=False, dtype=o.dtype, rngs=rngs)


LATENT_NORM_EPSILON = 1e-6
"""transformers builds DeepSeek V3's q_a_layernorm and kv_a_layernorm with the default epsilon,
not the config's rms_norm_eps."""


def _padded(t: jax.Array, width: int) -> jax.Array:
    """`t` with zeros after its last axis's features, up to `width`."""
    extra = width - t.shape[-1]
    return t if not extra else jnp.pad(t, [(0, 0)] * (t.ndim - 1) + [(0, extra)])


def _sinks(o: LayerOptions, rngs: nnx.Rngs) -> nnx.Param:
    """One sink logit per query head, split as the query heads are."""
    init = partitioned(nnx.initializers.normal(0.02), ("heads",))
    return nnx.Param(init(rngs.params(), (o.num_heads,), o.dtype))


def _as_tuple(axes: str | tuple[str, ...]) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes)


class GatedMLP(nnx.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with silu, GeGLU with tanh-approximated GELU (or the
    clamped SwiGLU of `Gated`)."""

    def __init__(self, options: LayerOptions, *, rngs: nnx.Rngs):
        o = options
        bias, dtype = o.mlp_bias, o.dtype
        self.gate, self.up = (
            _dense(o.dim, o.mlp_dim, ("mlp", "embed"), ("mlp",), bias=bias, dtype=dtype, rngs=rngs)
            for _ in range(2)
        )
        self.down = _dense(
            o.mlp_dim, o.dim, ("embed", "mlp"), (None,), bias=bias, dtype=dtype, rngs=rngs
        )
        self.gated = o.gated

    def __call__(self, x: jax.Array) -> jax.Array:
        hidden = logical_spec("batch", None, "mlp")
        gate, up = self.gate(x, out_sharding=hidden), self.up(x, out_sharding=hidden)
        return self.down(self.gated(gate, up), out_sharding=tokens_spec())


class DecoderLayer(nnx.Module):
    """x + post(attention(norm(x))), then x + post(mlp(norm(x))); `post` is a norm with
    `post_norms` (Gemma), else nothing. Dropout on each branch's output at `dropout_rate`."""

    def __init__(self, options: LayerOptions, *, rngs: nnx.Rngs):
        self.attention_norm = options.norm(options.dim, rngs)
        self.attention = (
            LatentAttention(options, rngs=rngs)
            if options.kv_lora_rank
            else Attention(options, rngs=rngs)
        )
        self.post_attention_norm = options.norm(options.dim, rngs) if options.post_norms else None
        self.mlp_norm = options.norm(options.dim, rngs)
        self.mlp = _mlp(options, rngs)
        self.post_mlp_norm = options.norm(options.dim, rngs) if options.post_norms else None
        self.dropout = nnx.Dropout(options.dropout_rate)

    def __call__(
        self,
        x: jax.Array,
        key: jax.Array,
        angles: Rotation,
        window: int,
        cache: KVCache | None,
        slots: Slots | None,
        segments: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | None]:
        attention_key, mlp_key = jax.random.split(key)
        normed = self.attention_norm(x)
        h, cache = self.attention(normed, angles, window, cache, slots, segments)
        x = x + self.dropout(_after(self.post_attention_norm, h), rngs=attention_key)
        h = self.mlp(self.mlp_norm(x))
        return x + self.dropout(_after(self.post_mlp_norm, h), rngs=mlp_key), cache


def _mlp(o: LayerOptions, rngs: nnx.Rngs) -> GatedMLP | MixtureOfExperts:
    if o.experts is None:
        return GatedMLP(o, rngs=rngs)
    width = o.experts.shared_mlp_dim
    shared = GatedMLP(dataclasses.replace(o, mlp_dim=width), rngs=rngs) if width else None
    return MixtureOfExperts(o.dim, o.experts, o.gated, dtype=o.dtype, rngs=rngs, shared=shared)


def _after(norm: RMSNorm | None, h: jax.Array) -> jax.Array:
    return h if norm is None else norm(h)

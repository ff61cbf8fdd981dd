"""A modern decoder-only language model: the architecture of Llama 3, Qwen 2.5 and 3, Mistral and
Gemma 3, trained from scratch (bytes by default, or a tokenizer's ids) or loaded from their
checkpoints (`zoo.models.decoder_params`).

Token embedding (times sqrt(dim) with `embed_scale`, Gemma) -> layers of RMSNorm, grouped-query
attention (or DeepSeek V3's multi-head latent attention, `kv_lora_rank`) with rotary positions
and a gated MLP or a mixture of experts (`zoo.models.decoder_parts`) -> final RMSNorm ->
logits through the embedding (tied) or a separate output layer, soft-capped with
`final_softcap`. Its options travel as one typed object, `DecoderOptions`
(`zoo.models.decoder_options`), whose fields are the `model.*` config keys; those the
checkpoints differ in say which family uses them. Each layer attends to every earlier position
(`full_attention`) or to the last `sliding_window` only (`sliding_attention`), by
`layer_types`; sliding layers may rotate with their own base (`local_rope_theta`, Gemma 3's
local layers).

As in `gpt` (`zoo.models.language_model`): the vocabulary is padded to a multiple of 128 rows,
the padded logits masked; `scan_layers` stacks the layers and runs them with `nnx.scan` (layers
of both types too: each scanned step runs the branch of its layer's type), `remat` recomputes a
layer's activations in the backward pass; every layer is initialised from its own key either
way, so both layouts hold the same weights. `decode(tokens, cache, slots)` runs new tokens
against a key/value cache of `num_kv_heads` heads, a sliding layer's bounded by its window
(`zoo.models.kv_cache`; generation: `zoo.models.sampling_loop`). A packed row of several
sequences (`data.packing`, `zoo.data.packing`) comes with each token's sequence and position in
it: attention stays within a sequence, in every kind of layer, and rotary positions restart at
each.

`param_dtype=bf16` holds every param in bfloat16 (a checkpoint as it is stored: half the
memory) and computes in it; norms' statistics and attention's softmax stay float32, as does the
loss.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from zoo.models.decoder_options import DecoderOptions
from zoo.models.decoder_parts import (
    FULL,
    SLIDING,
    DecoderLayer,
    LayerOptions,
    kv_heads_spec,
)
from zoo.models.expert_load import decoder_on_eval
from zoo.models.experts import ExpertOptions, routed_call
from zoo.models.kv_cache import Cache, DecodesWithCache, empty_cache
from zoo.models.language_model import (
    LANGUAGE_MODEL_OPTIMIZER,
    LANGUAGE_MODEL_TRAINER,
    embedded,
    language_model_loss,
    layers_dropout_key,
    output_logits,
    padded_vocab,
)
from zoo.models.layers import layer_stack
from zoo.models.rope import Rope, Rotation, rotation, yarn_mscale
from zoo.models.sampling_loop import sample_completions

from zoo.plugin import (
    TransposedLinear,
    construction_rngs,
    logical_spec,
    partitioned,
    register_model,
)


@register_model(
    "decoder",
    loss=language_model_loss,
    default_data="text",
    on_eval=decoder_on_eval,
    sample=sample_completions,
    trainer=LANGUAGE_MODEL_TRAINER,  # gpt's schedule and optimizer
    optimizer=LANGUAGE_MODEL_OPTIMIZER,
    tiny=(
        "model.context_length=32",
        "model.dim=32",
        "model.depth=2",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        "model.mlp_dim=64",
        "model.sliding_window=8",
        "model.layer_types=[sliding_attention,full_attention]",
        "model.qk_norm=true",
        "data.window=32",
        "data.eval_bytes=4096",
    ),
)
class Decoder(nnx.Module, DecodesWithCache):
    PACKED_ROWS = True
    """It takes packed rows (`segment_ids`, `positions`: see `__call__`)."""

    def __init__(self, options: DecoderOptions, *, rngs: nnx.Rngs):
        """The model `options` describe (each field a `model.*` key), its params drawn from
        `rngs` in a fixed order: the embedding, the layers (each from its own key), the final
        norm, the output layer."""
        o = options.resolved()
        each_layer = _layer_options(o)
        init = partitioned(nnx.initializers.normal(0.02), ("vocab", "embed"))
        rows = (padded_vocab(o.vocab_size), o.dim)
        self.embedding = nnx.Param(init(rngs.params(), rows, o.dtype))
        self.layers = _layers(o, each_layer, rngs.params())
        self.norm = each_layer.norm(o.dim, rngs)
        self.unembed = None if o.tie_embeddings else _unembed(o, rngs)
        self.rope, self.local_rope = _ropes(o)
        self.sliding_window, self.layer_types = o.sliding_window, tuple(o.layer_types)
        self.vocab_size, self.context_length, self.depth = o.vocab_size, o.context_length, o.depth
        self.num_kv_heads, self.head_dim = o.num_kv_heads, o.head_dim
        self.rotary_dim, self.cached_widths = o.rotary_dim, _cached_widths(o)
        self.embed_scale = float(np.float32(math.sqrt(o.dim))) if o.embed_scale else 0.0
        self.final_softcap = o.final_softcap
        self.scan_layers, self.remat, self.dropout_rate = o.scan_layers, o.remat, o.dropout_rate

    def __call__(
        self,
        tokens: jax.Array,
        *,
        rngs: nnx.Rngs | None = None,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> jax.Array:
        """Next-token logits (batch x length x padded vocabulary; the padded rows' are masked)
        for every position of `tokens`. A packed row (`zoo.data.packing`) gives each token's
        sequence, `segment_ids` (batch x length), and its position within it, `positions`:
        a token then attends to its own sequence's alone, at rotary positions from 0 in each."""
        key = layers_dropout_key(rngs, self.layers, self.scan_layers, self.dropout_rate, "decoder")
        logits, _ = self._forward(tokens, key, None, None, segment_ids, positions)
        return logits

    def with_auxiliary_loss(self, call, real: jax.Array):
        """`call(self)`, its mixtures' router load-balancing loss times `router_aux_loss_coef`
        over the input tokens `real` marks, and what TensorBoard shows of the routing
        (`zoo.plugin.AuxiliaryLoss`: how the preference and reward objectives train with it);
        0 and nothing to show without experts."""
        out, routing = routed_call(self, call)
        if not routing.layers:
            return out, jnp.zeros((), jnp.float32), {}
        loss, metrics = routing.loss_and_metrics(real)
        return out, loss, metrics

    def empty_cache(self, batch_size: int, slots: int) -> Cache:
        """A key/value cache for `decode` of `num_kv_heads` heads, in the dtype the model
        computes in (its params'): `slots` positions for every full-attention layer, at most
        its window for a sliding one (a ring buffer, `zoo.models.kv_cache`); with
        `scan_layers`, one array of all layers, `slots` long. Latent attention's holds one
        "head" of each token's latent and one of its rotated key (`LatentAttention`)."""
        heads = 1 if self.cached_widths else self.num_kv_heads
        keys, values = self.cached_widths or (self.head_dim, self.head_dim)
        spec = kv_heads_spec(heads, "batch", None, "kv_heads", None)
        if self.cached_widths:  # one latent "head", split over no devices
            spec = logical_spec("batch", None, None, None)
        return empty_cache(
            batch_size,
            slots,
            (heads, keys),
            dtype=self.embedding[...].dtype,
            spec=spec,
            windows=[self._window(kind) for kind in self.layer_types],
            stacked=self.scan_layers,
            value_width=values,
        )

    def _forward(self, tokens, key, cache, slots, segments=None, positions=None, last_only=False):
        table = self.embedding[...]
        x = embedded(tokens, table, self.context_length, "decoder")
        if self.embed_scale:
            x = x * jnp.asarray(self.embed_scale, table.dtype)
        if positions is None:  # a row's own, known now: the rotation's tables are constants
            length = tokens.shape[1]
            positions = np.arange(length) if slots is None else slots.positions(length)
        angles = self._angles(positions, x.dtype)
        keys = jax.random.split(key, self.depth)
        x, cache = self._run_layers(x, keys, angles, cache, slots, segments)
        logits = output_logits(
            x,
            norm=self.norm,
            table=table,
            unembed=self.unembed,
            vocab_size=self.vocab_size,
            last_only=last_only,
            softcap=self.final_softcap,
        )
        return logits, cache

    def _angles(self, positions, dtype: jnp.dtype) -> dict[str, Rotation]:
        """The rotation of each kind of layer at `positions`: one, where both kinds share it."""
        full = rotation(self.rope, self.rotary_dim, positions, dtype)
        if self.local_rope == self.rope:
            return {FULL: full, SLIDING: full}
        return {FULL: full, SLIDING: rotation(self.local_rope, self.rotary_dim, positions, dtype)}

    def _window(self, kind: str) -> int:
        return self.sliding_window if kind == SLIDING else 0

    def _step(self, kind: str):
        """One layer of type `kind` as a function of the layer and its inputs (rematerialised
        with `remat`); the window and which rotation it takes are fixed by `kind`."""
        window = self._window(kind)

        def apply(layer, x, key, cache, slots, angles, segments):
            return layer(x, key, angles[kind], window, cache, slots, segments)

        return nnx.remat(apply) if self.remat else apply

    def _run_layers(self, x, keys, angles: dict[str, Rotation], cache, slots, segments):
        if self.scan_layers:
            return self._scan_layers(x, keys, angles, cache, slots, segments)
        layer_caches = []
        for i, (layer, kind) in enumerate(zip(self.layers, self.layer_types, strict=True)):
            layer_cache = None if cache is None else cache[i]
            step = self._step(kind)
            x, layer_cache = step(layer, x, keys[i], layer_cache, slots, angles, segments)
            layer_caches.append(layer_cache)
        return x, None if cache is None else tuple(layer_caches)

    def _scan_layers(self, x, keys, angles, cache, slots, segments):
        steps = {kind: self._step(kind) for kind in set(self.layer_types)}
        sliding = jnp.asarray([kind == SLIDING for kind in self.layer_types])

        @nnx.scan(in_axes=(0, nnx.Carry, 0, 0, 0, None, None, None), out_axes=(nnx.Carry, 0))
        def scan(layer, x, key, layer_cache, is_sliding, slots, angles, segments):
            args = (layer, x, key, layer_cache, slots, angles, segments)
            if len(steps) == 1:
                (step,) = steps.values()
                return step(*args)
            # Layers of both types: each scanned step runs the branch of its layer's type.
            return nnx.cond(is_sliding, steps[SLIDING], steps[FULL], *args)

        return scan(self.layers, x, keys, cache, sliding, slots, angles, segments)


def _layers(o: DecoderOptions, each_layer: LayerOptions, key: jax.Array) -> nnx.Module:
    """The layers, stacked or in a list (`layer_stack`); in a mixture-of-experts model the
    `dense_layers` with a gated MLP, the others with experts."""
    dense = dataclasses.replace(each_layer, experts=None)
    if not o.num_experts or not o.dense_layers:
        return layer_stack(partial(DecoderLayer, each_layer), o.depth, o.scan_layers, key)
    keys = jax.random.split(key, o.depth)
    return nnx.List(
        DecoderLayer(
            each_layer if o.layer_has_experts(i) else dense,
            rngs=construction_rngs(params=keys[i]),
        )
        for i in range(o.depth)
    )


def _layer_options(o: DecoderOptions) -> LayerOptions:
    """What every layer is built from, of `resolved` options."""
    experts = None
    if o.num_experts:
        experts = ExpertOptions(
            o.num_experts,
            o.experts_per_token,
            o.expert_mlp_dim,
            o.normalize_expert_weights,
            o.router_aux_loss_coef,
            router_bias=o.router_bias,
            router_softmax=o.router_softmax,
            bias=o.mlp_bias,
            groups=o.router_groups,
            groups_kept=o.router_groups_kept,
            weight_scale=o.expert_weight_scale,
            shared_mlp_dim=o.shared_expert_mlp_dim,
        )
    return LayerOptions(
        dim=o.dim,
        num_heads=o.num_heads,
        num_kv_heads=o.num_kv_heads,
        head_dim=o.head_dim,
        mlp_dim=o.mlp_dim,
        activation=o.activation,
        swiglu_limit=o.swiglu_limit,
        swiglu_alpha=o.swiglu_alpha,
        norm_epsilon=o.norm_epsilon,
        norm_unit_offset=o.norm_unit_offset,
        post_norms=o.post_norms,
        qk_norm=o.qk_norm,
        qkv_bias=o.qkv_bias,
        out_bias=o.out_bias,
        mlp_bias=o.mlp_bias,
        attention_sinks=o.attention_sinks,
        query_scale=o.query_scale,
        attention_softcap=o.attention_softcap,
        dropout_rate=o.dropout_rate,
        dtype=o.dtype,
        experts=experts,
        rope_interleaved=o.rope_interleaved,
        kv_lora_rank=o.kv_lora_rank,
        q_lora_rank=o.q_lora_rank,
        rope_head_dim=o.rope_head_dim,
        value_head_dim=o.value_head_dim,
        logit_mscale=_logit_mscale(o),
    )


def _logit_mscale(o: DecoderOptions) -> float:
    """The factor whose square latent attention's logits are also multiplied by: DeepSeek's
    YaRN `mscale_all_dim` (1 without it)."""
    return yarn_mscale(o.rope_factor, o.rope_mscale_all_dim) if o.rope_mscale_all_dim else 1.0


def _cached_widths(o: DecoderOptions) -> tuple[int, int] | None:
    """Latent attention's cache widths (the latent's, the rotated key's); None: keys and
    values of head_dim."""
    return (o.kv_lora_rank, o.rope_head_dim) if o.kv_lora_rank else None


def _unembed(o: DecoderOptions, rngs: nnx.Rngs) -> TransposedLinear:
    """The output layer of untied embeddings."""
    rows = padded_vocab(o.vocab_size)
    axes = ("vocab", "embed")
    return TransposedLinear(o.dim, rows, kernel_axes=axes, param_dtype=o.dtype, rngs=rngs)


def _ropes(o: DecoderOptions) -> tuple[Rope, Rope]:
    """The rotary frequencies of full-attention layers, and of sliding-window ones."""
    rope = Rope(
        o.rope_theta,
        o.rope_type,
        o.rope_factor,
        o.rope_low_freq_factor,
        o.rope_high_freq_factor,
        o.rope_original_context,
        o.rope_beta_fast,
        o.rope_beta_slow,
        o.rope_truncate,
        o.rope_attention_factor,
    )
    return rope, Rope(o.local_rope_theta) if o.local_rope_theta else rope

"""The options of `decoder` as one typed object, `DecoderOptions`: its fields are the model's
`model.*` config keys (the registry makes the config schema of them, so an option is declared
once), they are refused by name when no model can be built with them, and `resolved` says what
each 0 or null among them stands for.

The options are those the checkpoints differ in; each says which family uses it.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from zoo.models import hparams
from zoo.models.decoder_parts import ACTIVATION_NAMES, FULL, LAYER_TYPES, SLIDING
from zoo.models.experts import ROUTER_SOFTMAX
from zoo.models.language_model import VOCAB
from zoo.models.rope import ROPE_TYPES

from zoo.plugin import ZooError

PARAM_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class DecoderOptions:
    """Everything a `decoder` is built from, checked when made (a `ZooError` naming the
    config key and what would be valid)."""

    # Tokens in the vocabulary: 256 bytes without a tokenizer; with data.tokenizer, at least its
    # ids.
    vocab_size: int = VOCAB
    # Positions the model has (a checkpoint's max_position_embeddings): sequences, and the
    # key/value cache of generation, are at most this long.
    context_length: int = 128
    dim: int = 128  # width of the token embeddings and every layer (hidden_size)
    depth: int = 4  # layers (num_hidden_layers)
    num_heads: int = 4  # query heads (num_attention_heads)
    # Key/value heads, each shared by num_heads / num_kv_heads query heads (grouped-query
    # attention; 1: multi-query); 0: as many as num_heads.
    num_kv_heads: int = 0
    # Features of each head; 0: dim / num_heads (Qwen 3 and Gemma 3 set it independently).
    head_dim: int = 0
    # Hidden width of the gated MLP (intermediate_size); 0: 8/3 of dim rounded up to a multiple
    # of 64, which holds about the weights of a 4 x dim two-layer MLP.
    mlp_dim: int = 0
    # The gated MLP's activation: `silu` (SwiGLU: Llama, Mistral, Qwen), `gelu_tanh` (GeGLU
    # with tanh-approximated GELU: Gemma) or `clamped_swiglu` (gpt-oss: the gate capped at
    # swiglu_limit, the up projection clipped to +-swiglu_limit, then
    # (up + 1) * gate * sigmoid(swiglu_alpha * gate)).
    activation: str = "silu"
    swiglu_limit: float = 7.0  # `clamped_swiglu`: the cap of the gate and the up projection
    swiglu_alpha: float = 1.702  # `clamped_swiglu`: the gain of its sigmoid
    norm_epsilon: float = 1e-6  # epsilon of every RMSNorm (rms_norm_eps)
    # RMSNorm scales by 1 + w instead of w (Gemma), w held as the checkpoint stores it.
    norm_unit_offset: bool = False
    # A norm after attention and after the MLP too, before each is added back (Gemma).
    post_norms: bool = False
    qk_norm: bool = False  # RMSNorm of each query and key head before the rotation (Qwen 3)
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen 2)
    out_bias: bool = False  # a bias on attention's output projection
    # Biases on the MLP's gate, up and down projections (and on each expert's, gpt-oss).
    mlp_bias: bool = False
    # A learned logit per query head in each query's softmax, with no value (gpt-oss's
    # attention sinks): a head may give the keys less than all of its weight.
    attention_sinks: bool = False
    # Multi-head latent attention (DeepSeek V3's) when > 0: keys and values are projected
    # from one compressed latent of this width per token (kv_lora_rank, RMS-normed), which the
    # key/value cache holds with the rotated key features, in place of every head's keys and
    # values; 0: grouped-query attention.
    kv_lora_rank: int = 0
    # Latent attention: the queries projected through a normed latent of this width
    # (q_lora_rank); 0: by one projection (a q_lora_rank of null).
    q_lora_rank: int = 0
    # Latent attention: the last rope_head_dim of each query and key head's head_dim features
    # are rotated (qk_rope_head_dim; the key's shared by every head), the others not
    # (qk_nope_head_dim = head_dim - rope_head_dim).
    rope_head_dim: int = 0
    value_head_dim: int = 0  # latent attention: each value head's width (v_head_dim); 0: head_dim
    # Rotate neighbouring features in pairs, (0, 1), (2, 3), ..., and lay the results out as
    # halves (DeepSeek V3's rope_interleave); false: feature i with feature i + head_dim / 2.
    rope_interleaved: bool = False
    rope_theta: float = 10000.0  # base of the rotary frequencies of full-attention layers
    # Scaling of those frequencies: `default` (none), `linear` (divided by rope_factor),
    # `llama3` (Llama 3.1's, with the three parameters below) or `yarn` (YaRN, gpt-oss's).
    rope_type: str = "default"
    rope_factor: float = 1.0  # the `linear`, `llama3` and `yarn` scaling factor
    rope_low_freq_factor: float = 1.0  # `llama3`: low_freq_factor
    rope_high_freq_factor: float = 4.0  # `llama3`: high_freq_factor
    # `llama3` and `yarn`: original_max_position_embeddings, the context trained before scaling.
    rope_original_context: int = 8192
    # `yarn`: frequencies turning more than this many times over the original context are kept
    # (beta_fast), a linear ramp down to those of rope_beta_slow.
    rope_beta_fast: float = 32.0
    # `yarn`: frequencies turning fewer than this many times over the original context are
    # divided by rope_factor (beta_slow).
    rope_beta_slow: float = 1.0
    rope_truncate: bool = True  # `yarn`: the ramp's ends rounded outwards to whole features
    # `yarn`: the factor of the rotation's cosines and sines (attention_factor); 0: from
    # rope_factor, 0.1 ln(rope_factor) + 1.
    rope_attention_factor: float = 0.0
    # `yarn`, latent attention: DeepSeek's mscale_all_dim, the attention logits multiplied by
    # (0.1 rope_mscale_all_dim ln(rope_factor) + 1) ** 2 too; 0: not.
    rope_mscale_all_dim: float = 0.0
    # Base of sliding-window layers' rotary frequencies, unscaled (Gemma 3: 10000); 0: those of
    # the full-attention layers, scaling included.
    local_rope_theta: float = 0.0
    # Positions a sliding-window layer sees, itself included (a query at i sees keys j with
    # i - sliding_window < j <= i); 0: no sliding-window layers.
    sliding_window: int = 0
    # Each layer's attention, `full_attention` or `sliding_attention`, one per layer; null:
    # every layer sliding when sliding_window > 0 (Mistral), else every layer full.
    layer_types: list[str] | None = None
    # Attention logits are scaled by query_scale ** -0.5; 0: head_dim (Gemma 3 sets its
    # query_pre_attn_scalar).
    query_scale: float = 0.0
    # Attention logits soft-capped to (-cap, cap) by cap * tanh(logits / cap); 0: not capped.
    attention_softcap: float = 0.0
    final_softcap: float = 0.0  # the output logits soft-capped the same way; 0: not capped
    # Embeddings multiplied by sqrt(dim), rounded to the params' dtype (Gemma).
    embed_scale: bool = False
    # Logits through the input embedding; false: a separate output layer.
    tie_embeddings: bool = True
    dropout_rate: float = 0.0  # Dropout on each layer's attention and MLP outputs
    # Experts of each mixture-of-experts layer (num_experts, num_local_experts); 0: every
    # layer's MLP is one gated MLP.
    num_experts: int = 0
    experts_per_token: int = 2  # experts each token is routed to (num_experts_per_tok)
    # Hidden width of each expert's gated MLP (moe_intermediate_size); 0: mlp_dim.
    expert_mlp_dim: int = 0
    # Divide a token's chosen experts' probabilities by their sum (norm_topk_prob; Mixtral
    # always does); false: keep the softmax's over all the experts.
    normalize_expert_weights: bool = True
    # The layers (counted from 0) whose MLP stays dense when num_experts > 0 (Qwen3-MoE's
    # mlp_only_layers, and the layers its decoder_sparse_step skips); null: none.
    dense_layers: list[int] | None = None
    # The weight of the router's load-balancing loss added to the training loss
    # (router_aux_loss_coef, where output_router_logits is true); 0: none.
    router_aux_loss_coef: float = 0.0
    router_bias: bool = False  # a bias on the router's logits (gpt-oss)
    # The experts' weights: `all`, the softmax over every expert (then the top ones kept;
    # Qwen3-MoE, Mixtral); `chosen`, the top experts by logit, then the softmax over their
    # logits alone (gpt-oss); `sigmoid`, each expert's sigmoid of its logit, the experts chosen
    # by it plus a learned correction bias that does not weigh them (DeepSeek V3).
    router_softmax: str = "all"
    # `sigmoid` routing: the experts split into this many groups, of which each token is routed
    # within the router_groups_kept whose two best experts score highest (n_group); 1: none.
    router_groups: int = 1
    router_groups_kept: int = 1  # the groups a token's experts come from (topk_group)
    # Every routed expert's weight multiplied by this (routed_scaling_factor).
    expert_weight_scale: float = 1.0
    # Hidden width of a gated MLP beside the experts that every token goes through, its output
    # added to theirs (DeepSeek V3's shared experts: n_shared_experts x moe_intermediate_size);
    # 0: none.
    shared_expert_mlp_dim: int = 0
    # Store the layers stacked (a leading layer axis) and run them with `nnx.scan`: compile time
    # no longer grows with depth; the same weights, another checkpoint layout.
    scan_layers: bool = False
    # Recompute each layer's activations in the backward pass (`nnx.remat`) instead of keeping
    # them: less memory, more compute.
    remat: bool = False
    # The dtype every param is held and computed in: `fp32`, or `bf16` (half the memory; a
    # bfloat16 checkpoint as it is stored).
    param_dtype: str = "fp32"

    def __post_init__(self) -> None:
        _check_values(self)
        _check_heads(self)
        _check_latent(self)
        _layer_types(self.layer_types, self.depth, self.sliding_window)
        _check_experts(self)

    def resolved(self) -> DecoderOptions:
        """These options with each 0 or null that stands for a default made explicit: the
        key/value heads, each head's width, the MLP's width and every layer's type."""
        return dataclasses.replace(
            self,
            num_kv_heads=self.num_kv_heads or self.num_heads,
            head_dim=self.head_dim or self.dim // self.num_heads,
            mlp_dim=self.mlp_dim or default_mlp_dim(self.dim),
            layer_types=_layer_types(self.layer_types, self.depth, self.sliding_window),
            value_head_dim=self._value_head_dim(),
            expert_mlp_dim=self.expert_mlp_dim or self.mlp_dim or default_mlp_dim(self.dim),
            dense_layers=sorted(set(self.dense_layers or ())),
        )

    def _value_head_dim(self) -> int:
        """Latent attention's value heads' width (0 without it: the values are head_dim)."""
        if not self.kv_lora_rank:
            return 0
        return self.value_head_dim or self.head_dim or self.dim // self.num_heads

    def layer_has_experts(self, index: int) -> bool:
        """Whether layer `index` is a mixture of experts (else one gated MLP)."""
        return self.num_experts > 0 and index not in (self.dense_layers or ())

    @property
    def rotary_dim(self) -> int:
        """The features of each head that rotary positions turn: latent attention's
        `rope_head_dim`, else the whole head."""
        if self.kv_lora_rank:
            return self.rope_head_dim
        return self.head_dim or self.dim // self.num_heads

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype of every param (`param_dtype`)."""
        return jnp.dtype(PARAM_DTYPES[self.param_dtype])


def default_mlp_dim(dim: int) -> int:
    """8/3 of `dim` rounded up to a multiple of 64: a gated MLP's three matrices then hold about
    the weights of a two-matrix MLP 4 x `dim` wide."""
    return 64 * -(-8 * dim // (3 * 64))


def _check_values(o: DecoderOptions) -> None:
    """Refuse, naming its key, a size, rate or choice out of its range."""
    hparams.positive(
        "decoder",
        vocab_size=o.vocab_size,
        context_length=o.context_length,
        dim=o.dim,
        depth=o.depth,
        num_heads=o.num_heads,
        rope_original_context=o.rope_original_context,
    )
    whole = ("num_kv_heads", "head_dim", "mlp_dim", "sliding_window", "shared_expert_mlp_dim")
    latent = ("kv_lora_rank", "q_lora_rank", "rope_head_dim", "value_head_dim")
    for key in (*whole, *latent):
        value = getattr(o, key)
        if not isinstance(value, int) or value < 0:
            raise ZooError(f"model.{key}={value} must be a whole number >= 0 (0: the default).")
    positive = (
        "norm_epsilon",
        "rope_theta",
        "rope_factor",
        "rope_beta_fast",
        "rope_beta_slow",
        "expert_weight_scale",
    )
    for key in (*positive, "swiglu_limit", "swiglu_alpha"):
        if not getattr(o, key) > 0:
            raise ZooError(f"model.{key}={getattr(o, key)} must be positive (decoder).")
    for key in (
        "local_rope_theta",
        "query_scale",
        "attention_softcap",
        "final_softcap",
        "rope_attention_factor",
        "rope_mscale_all_dim",
    ):
        value = getattr(o, key)
        if not (math.isfinite(value) and value >= 0):
            raise ZooError(f"model.{key}={value} must be >= 0 (0: off, or the default).")
    hparams.rates("decoder", dropout_rate=o.dropout_rate)
    hparams.choice(
        "decoder",
        activation=(o.activation, ACTIVATION_NAMES),
        rope_type=(o.rope_type, ROPE_TYPES),
        router_softmax=(o.router_softmax, ROUTER_SOFTMAX),
        param_dtype=(o.param_dtype, tuple(PARAM_DTYPES)),
    )


def _check_heads(o: DecoderOptions) -> None:
    """Refuse heads that do not split evenly, or rotary positions that cannot be computed."""
    num_heads, num_kv_heads = o.num_heads, o.num_kv_heads or o.num_heads
    if num_heads % num_kv_heads:
        raise ZooError(
            f"model.num_kv_heads={num_kv_heads} must divide model.num_heads={num_heads} "
            "(each key/value head serves an equal group of query heads)."
        )
    head_dim = o.rotary_dim
    if not o.head_dim and o.dim % num_heads:
        raise ZooError(
            f"model.dim={o.dim} must be a multiple of model.num_heads={num_heads} when "
            "model.head_dim=0 (the heads split dim); or give model.head_dim."
        )
    if head_dim % 2:
        raise ZooError(
            f"The rotated width of each head, {head_dim} (model.rope_head_dim with latent "
            "attention, else model.head_dim, or dim / num_heads), must be even: rotary "
            "positions turn pairs of features."
        )
    if o.rope_type == "llama3" and not o.rope_high_freq_factor > o.rope_low_freq_factor:
        raise ZooError(
            f"model.rope_high_freq_factor={o.rope_high_freq_factor} must exceed "
            f"model.rope_low_freq_factor={o.rope_low_freq_factor} for rope_type=llama3."
        )


def _check_latent(o: DecoderOptions) -> None:
    """Refuse latent attention's settings without it, and heads it cannot split."""
    if not o.kv_lora_rank:
        given = {
            "q_lora_rank": o.q_lora_rank,
            "rope_head_dim": o.rope_head_dim,
            "value_head_dim": o.value_head_dim,
            "rope_mscale_all_dim": o.rope_mscale_all_dim,
        }
        for key, value in given.items():
            if value:
                raise ZooError(
                    f"model.{key}={value} sets multi-head latent attention, and this model has "
                    "grouped-query attention (model.kv_lora_rank=0): set it to 0, or give "
                    "model.kv_lora_rank."
                )
        return
    head_dim = o.head_dim or o.dim // o.num_heads
    if not 0 < o.rope_head_dim < head_dim:
        raise ZooError(
            f"model.rope_head_dim={o.rope_head_dim} must be between 1 and model.head_dim - 1 "
            f"({head_dim - 1}) with latent attention (model.kv_lora_rank={o.kv_lora_rank}): "
            "each head has head_dim - rope_head_dim features without rotation."
        )
    if o.num_kv_heads not in (0, o.num_heads):
        raise ZooError(
            f"model.num_kv_heads={o.num_kv_heads} groups the key/value heads, but latent "
            f"attention (model.kv_lora_rank={o.kv_lora_rank}) gives every query head its own "
            "key and value from the shared latent: set model.num_kv_heads to 0 or "
            f"model.num_heads={o.num_heads}."
        )
    if o.rope_mscale_all_dim and o.rope_type != "yarn":
        raise ZooError(
            f"model.rope_mscale_all_dim={o.rope_mscale_all_dim} is YaRN's, and "
            f"model.rope_type={o.rope_type!r}: set it to 0, or model.rope_type='yarn'."
        )


def _check_experts(o: DecoderOptions) -> None:
    """Refuse a mixture no token can be routed through, or layers that do not exist."""
    for key in ("num_experts", "expert_mlp_dim"):
        value = getattr(o, key)
        if not isinstance(value, int) or value < 0:
            raise ZooError(f"model.{key}={value} must be a whole number >= 0 (0: off, or mlp_dim).")
    coef = o.router_aux_loss_coef
    if not isinstance(coef, int | float) or not 0 <= coef < math.inf:
        raise ZooError(
            f"model.router_aux_loss_coef={coef} must be a number >= 0 (0: no load-balancing loss)."
        )
    if not o.num_experts:
        _check_no_router(o)
        return
    if o.router_softmax == "chosen" and not o.normalize_expert_weights:
        raise ZooError(
            "model.normalize_expert_weights=false keeps the chosen experts' probabilities of a "
            "softmax over every expert, but model.router_softmax='chosen' takes the softmax over "
            "the chosen experts alone, whose weights sum to 1 already: set "
            "model.normalize_expert_weights=true, or model.router_softmax='all'."
        )
    if not 1 <= o.experts_per_token <= o.num_experts:
        raise ZooError(
            f"model.experts_per_token={o.experts_per_token} must be between 1 and "
            f"model.num_experts={o.num_experts}."
        )
    _check_groups(o)
    dense = list(o.dense_layers or ())
    outside = [i for i in dense if not 0 <= i < o.depth]
    if outside:
        raise ZooError(
            f"model.dense_layers={dense} names layers {outside} that model.depth={o.depth} does "
            f"not have: give layers from 0 to {o.depth - 1}."
        )
    if o.scan_layers and 0 < len(set(dense)) < o.depth:
        raise ZooError(
            f"model.scan_layers=true runs one layer's structure over every layer, but "
            f"model.dense_layers={dense} mixes dense layers with mixture-of-experts ones: set "
            "model.scan_layers=false."
        )


def _check_groups(o: DecoderOptions) -> None:
    """Refuse expert groups that do not split the experts, or that no routing but `sigmoid`
    reads, and a load-balancing loss that sigmoid scores are not the probabilities of."""
    groups, kept, count = o.router_groups, o.router_groups_kept, o.num_experts
    sigmoid = o.router_softmax == "sigmoid"
    if sigmoid and o.router_aux_loss_coef:
        raise ZooError(
            f"model.router_aux_loss_coef={o.router_aux_loss_coef} weighs a load-balancing loss of "
            "the router's probabilities, and model.router_softmax='sigmoid' scores each expert "
            "alone (DeepSeek V3 balances by its correction bias instead): set it to 0."
        )
    if groups == 1 and kept == 1:
        return
    if not sigmoid:
        raise ZooError(
            f"model.router_groups={groups} and model.router_groups_kept={kept} limit the "
            "experts to groups by their sigmoid scores, and model.router_softmax="
            f"{o.router_softmax!r}: set both to 1, or model.router_softmax='sigmoid'."
        )
    if not (groups >= 1 and count % groups == 0 and count // groups >= 2):
        raise ZooError(
            f"model.router_groups={groups} must split model.num_experts={count} into equal "
            "groups of at least 2 experts (a group scores by its two best)."
        )
    if not 1 <= kept <= groups or o.experts_per_token > kept * (count // groups):
        raise ZooError(
            f"model.router_groups_kept={kept} must be between 1 and model.router_groups={groups} "
            f"and hold model.experts_per_token={o.experts_per_token} experts "
            f"({count // groups} a group)."
        )


def _check_no_router(o: DecoderOptions) -> None:
    """Refuse a router's setting on a model without a mixture of experts, naming it."""
    if o.router_aux_loss_coef:
        raise ZooError(
            f"model.router_aux_loss_coef={o.router_aux_loss_coef} weighs the load-balancing loss "
            "of a mixture of experts' router, and this model has none (model.num_experts=0): "
            "set it to 0, or set model.num_experts."
        )
    given = {
        "router_bias": (o.router_bias, False),
        "router_softmax": (o.router_softmax, "all"),
        "router_groups": (o.router_groups, 1),
        "router_groups_kept": (o.router_groups_kept, 1),
        "expert_weight_scale": (o.expert_weight_scale, 1.0),
        "shared_expert_mlp_dim": (o.shared_expert_mlp_dim, 0),
    }
    for key, (value, off) in given.items():
        if value != off:
            raise ZooError(
                f"model.{key}={value!r} sets a mixture of experts' router, and this model has "
                f"none (model.num_experts=0): set it to {off!r}, or set model.num_experts."
            )


def _layer_types(given: list[str] | None, depth: int, window: int) -> list[str]:
    """Each layer's attention type: `given`, checked, or what null stands for."""
    if given is None:
        return [SLIDING if window else FULL] * depth
    given = list(given)
    if len(given) != depth:
        raise ZooError(
            f"model.layer_types={given} lists {len(given)} layers, but model.depth={depth}: "
            "give one type per layer (or null)."
        )
    for i, kind in enumerate(given):
        if kind not in LAYER_TYPES:
            raise ZooError(
                f"model.layer_types[{i}]={kind!r} is not a decoder layer type: choose one of "
                f"{', '.join(LAYER_TYPES)}."
            )
    if SLIDING in given and not window:
        raise ZooError(
            f"model.layer_types={given} has {SLIDING} layers but model.sliding_window=0: "
            "give the window's length in positions."
        )
    return given

"""Checkpoints of today's open-weight language models (transformers' `LlamaForCausalLM`,
`Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `MistralForCausalLM` and `Gemma3ForCausalLM`) for
`decoder`, recognised by `config.json`'s `model_type`.

The mixtures of experts (`Qwen3MoeForCausalLM`, `MixtralForCausalLM`, `GptOssForCausalLM`,
`DeepseekV3ForCausalLM`) add their routers' and experts' keys; DeepSeek V3's multi-head latent
attention has its own projections in place of q/k/v (`_latent_rules`), and its
multi-token-prediction layers, after the last layer, are ignored as transformers ignores them.

They share one layout of keys (`model.embed_tokens`, `model.layers.N.self_attn.{q,k,v,o}_proj`,
`mlp.{gate,up,down}_proj`, RMSNorm scales, `model.norm`, `lm_head` when not tied) and differ in
options, which `hparams` reads from the config as transformers 5 does, in both layouts users
have: the one transformers 5 writes (`rope_parameters`; for Gemma 3 one per layer type, and
`layer_types`) and the one of checkpoints saved by transformers 4 (top-level `rope_theta` and
`rope_scaling`; Gemma 3's `rope_local_base_freq` and `sliding_window_pattern`). A key absent from
the config takes transformers' default for the family.

Every key of a family's config is accounted for: read by `hparams` (`HONOURED`), known not to
change what the model computes (`INERT`, besides the `COMMON_INERT` of every config: dropout,
which inference skips, and the cache transformers generates with), or refused with a `ZooError`
naming the key, its value and what `decoder` implements: RoPE scalings other than default,
linear and llama3, a partial rotary factor, an activation other than SiLU and tanh GELU,
interleaved RoPE, bidirectional attention, Gemma 3's attention soft-capping (which transformers
does not apply), quantized weights (but gpt-oss's MXFP4 experts, decoded at load). Export
writes the family's config in transformers 5's layout with transformers 4's keys beside it (the
same RoPE and layers, which both versions read), unquantized, and refuses a model that the
layout cannot hold (it would read back as another).

Projections are stored (out, in) by torch's `nn.Linear`; `decoder` holds them (in, out) with
the heads split out: q/k/v (dim, heads, head_dim), o (heads, head_dim, dim). Embedding rows and
the output layer's columns are padded to `decoder`'s padded vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from zoo.models.decoder_options import DecoderOptions
from zoo.models.decoder_parts import CLAMPED_SWIGLU, FULL, SLIDING
from zoo.models.language_model import padded_vocab
from zoo.models.rope import ROPE_TYPES, yarn_mscale

from zoo.plugin import (
    Combine,
    Family,
    Rule,
    ZooError,
    dequantize_mxfp4,
    mxfp4_shape,
    register_family,
)

DEFAULT_THETA = 10000.0
_SILU = ("silu", "swish")
_TANH_GELU = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast")

_ROPE_KEYS = {
    "default": {"rope_type", "type", "rope_theta", "partial_rotary_factor"},
    "linear": {"rope_type", "type", "rope_theta", "partial_rotary_factor", "factor"},
    "llama3": {
        "rope_type",
        "type",
        "rope_theta",
        "partial_rotary_factor",
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    },
    "yarn": {
        "rope_type",
        "type",
        "rope_theta",
        "partial_rotary_factor",
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "truncate",
        "attention_factor",
        "mscale",
        "mscale_all_dim",
    },
}

_INERT = ("attention_dropout", "cache_implementation", "id2label", "transformers.js_config")
"""Keys of these families' configs, besides the `COMMON_INERT` of every config, that do not
change what the model computes: dropout (off at inference; `decoder`'s own `dropout_rate`
decides it in training), the cache transformers' generation uses, labels' names, the settings
of transformers.js (a JavaScript runtime)."""

_SIZES = (
    "vocab_size",
    "max_position_embeddings",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "rms_norm_eps",
    "tie_word_embeddings",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "partial_rotary_factor",
    "original_max_position_embeddings",
    "quantization_config",
)
"""The keys every family reads (or refuses: `quantization_config`, `partial_rotary_factor`)."""


@dataclasses.dataclass(frozen=True)
class _Kind:
    """What tells one family apart: its names, transformers' defaults for absent keys, the
    keys it reads besides `_SIZES` and those that do not change the computation, its options
    as `decoder`'s constructor arguments (`options(config, read)`, `read(key)` giving a key's
    value or its default), the config keys that write them back (`export(hparams)`) and the
    quantized tensors its checkpoints may store in parts, decoded at load (`quantized`)."""

    name: str
    architecture: str
    description: str
    defaults: Mapping[str, Any]
    honoured: tuple[str, ...]
    inert: tuple[str, ...]
    options: Callable[[Mapping[str, Any], Callable[[str], Any]], dict[str, Any]]
    export: Callable[[Mapping[str, Any]], dict[str, Any]]
    quantized: tuple[Combine, ...] = ()


def _llama_options(config: Mapping[str, Any], read: Callable[[str], Any]) -> dict[str, Any]:
    if read("rope_interleaved"):
        raise ZooError(
            "This llama config has rope_interleaved=true (RoPE on neighbouring features, as "
            "nanotron trains them), which transformers' LlamaForCausalLM does not read: it "
            "rotates the two halves of each head, as decoder does. Convert the checkpoint's "
            "q/k projections to the halves layout, or set rope_interleaved=false if they are."
        )
    bias = bool(read("attention_bias"))
    return {
        "activation": _activation(read, "hidden_act"),
        "qkv_bias": bias,
        "out_bias": bias,
        "mlp_bias": bool(read("mlp_bias")),
        **_global_rope(config, read),
    }


def _llama_export(hparams: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "hidden_act": _hidden_act(hparams),
        "attention_bias": hparams["qkv_bias"],
        "mlp_bias": hparams["mlp_bias"],
        "pretraining_tp": 1,
        "rope_parameters": _rope_parameters(hparams),
    }


def _qwen2_options(config: Mapping[str, Any], read: Callable[[str], Any]) -> dict[str, Any]:
    return {
        "activation": _activation(read, "hidden_act"),
        "qkv_bias": True,
        **_global_rope(config, read),
        **_qwen_windows(config, read),
    }


def _qwen2_export(hparams: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "hidden_act": _hidden_act(hparams),
        "rope_parameters": _rope_parameters(hparams),
        **_qwen_windows_config(hparams),
    }


def _qwen3_options(config: Mapping[str, Any], read: Callable[[str], Any]) -> dict[str, Any]:
    return {**_qwen3_attention(config, read), **_qwen_windows(config, read)}


def _qwen3_attention(config: Mapping[str, Any], read: Callable[[str], Any]) -> dict[str, Any]:
    bias = bool(read("attention_bias"))
    return {
        "activation": _activation(read, "hidden_act"),
        "qk_norm": True,
        "qkv_bias": bias,
        "out_bias": bias,
        **_global_rope(config, read),
    }


def _qwen3_export(hparams: Mapping[str, Any]) -> dict[str, Any]:
    return {**_qwen3_attention_config(hparams), **_qwen_windows_config(hparams)}


def _qwen3_attention_config(hparams: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "hidden_act": _hidden_act(hparams),
        "attention_bias": hparams["qkv_bias"],
        "rope_parameters": _rope_parameters(hparams),
    }


def _qwen3_moe_options(config: Mapping[str, Any], read: Callable[[str], Any]) -> dict[str, Any]:
    """Qwen 3's attention, and on layers `(i + 1) % decoder_sparse_step == 0` not in
    `mlp_only_layers` a mixture of experts (every layer dense without experts)."""
    count = _expert_count(config, read)
    depth, step = int(read("num_hidden_layers")), int(read("decoder_sparse_step"))
    only = set(read("mlp_only_layers") or ())
    sparse = [i not in only and count > 0 and (i + 1) % step == 0 for i in range(depth)]
    experts = {"num_experts": 0, "dense_layers": None}
    if any(sparse):
        experts = {
            "num_experts": count,
            "experts_per_token": int(read("num_experts_per_tok")),
            "expert_mlp_dim": int(read("moe_intermediate_size")),
            "normalize_expert_weights": bool(read("norm_topk_prob")),
            "dense_layers": [i for i in range(depth) if not sparse[i]] or None,
            "router_aux_loss_coef": _router_loss(read),
        }
    return {**_qwen3_attention(config, read), **_every_layer_window(read), **experts}


def _every_layer_window(read: Callable[[str], Any]) -> dict[str, Any]:
    """Qwen3-MoE's window as transformers' Qwen3MoeForCausalLM reads it: `sliding_window` on
    every layer where `use_sliding_window`, none otherwise (its config has no
    `max_window_layers` nor `layer_types`: a checkpoint's are not read, as there)."""
    window = read("sliding_window") if read("use_sliding_window") else None
    return {"sliding_window": int(window or 0), "layer_types": None}


def _every_layer_window_config(hparams: Mapping[str, Any]) -> dict[str, Any]:
    kinds = set(hparams["layer_types"])
    if len(kinds) > 1:
        raise ZooError(
            f"This model's layers are of kinds {sorted(kinds)}: a qwen3_moe checkpoint has one "
            "sliding_window on every layer or on none (transformers' Qwen3MoeForCausalLM), so "
            "layers of both kinds cannot be written as one."
        )
    window = hparams["sliding_window"] if kinds == {SLIDING} else 0
    return {"use_sliding_window": bool(window), "sliding_window": window or None}


def _qwen3_moe_export(hparams: Mapping[str, Any]) -> dict[str, Any]:
    count = _experts_to_export(hparams, "qwen3_moe", "qwen3")
    return {
        **_qwen3_attention_config(hparams),
        **_every_layer_window_config(hparams),
        "num_experts": count,
        "num_experts_per_tok": hparams["experts_per_token"],
        "moe_intermediate_size": hparams["expert_mlp_dim"],
        "norm_topk_prob": hparams["normalize_expert_weights"],
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(hparams["dense_layers"] or ()),
        **_router_loss_export(hparams),
    }


def _mixtral_options(config: Mapping[str, Any], read: Callable[[str], Any]) -> dict[str, Any]:
    """Mistral's attention, every layer's MLP a mixture of experts whose chosen weights sum
    to 1."""
    if read("router_jitter_noise"):
        raise ZooError(
            f"This mixtral config has router_jitter_noise={read('router_jitter_noise')!r}, "
            "which multiplies the router's input by noise in training; decoder routes without "
            "noise: router_jitter_noise 0 only."
        )
    return {
        **_mistral_options(config, read),
        "num_experts": _expert_count(config, read),
        "experts_per_token": int(read("num_experts_per_tok")),
        "expert_mlp_dim": int(read("intermediate_size")),
        "normalize_expert_weights": True,
        "dense_layers": None,
        "router_aux_loss_coef": _router_loss(read),
    }


def _mixtral_export(hparams: Mapping[str, Any]) -> dict[str, Any]:
    return {
        **_mistral_export(hparams),
        "num_local_experts": _experts_to_export(hparams, "mixtral", "mistral"),
        "num_experts_per_tok": hparams["experts_per_token"],
        **_router_loss_export(hparams),
        "router_jitter_noise": 0.0,
    }


def _gpt_oss_options(config: Mapping[str, Any], read: Callable[[str], Any]) -> dict[str, Any]:
    """gpt-oss: sinks in every attention layer, biases on all four projections
    (`attention_bias`), sliding and full layers alternating (`layer_types`, by default sliding
    first), YaRN (transformers' default where the config gives no RoPE), and on every layer
    a mixture of biased experts, routed by the softmax over the chosen logits of a biased
    router, joined by the clamped SwiGLU."""
    given = config.get("rope_scaling") or config.get("rope_parameters")
    rope_config = config if given else {**config, "rope_parameters": dict(_GPT_OSS_ROPE)}
    bias = bool(read("attention_bias"))
    return {
        "activation": CLAMPED_SWIGLU,
        "swiglu_limit": float(read("swiglu_limit")),
        "swiglu_alpha": float(read("swiglu_alpha")),
        "qkv_bias": bias,
        "out_bias": bias,
        "mlp_bias": True,
        "attention_sinks": True,
        **_global_rope(rope_config, read),
        **_gpt_oss_windows(config, read),
        "num_experts": _expert_count(config, read),
        "experts_per_token": int(read("num_experts_per_tok")),
        "expert_mlp_dim": int(read("intermediate_size")),
        "normalize_expert_weights": True,
        "router_bias": True,
        "router_softmax": "chosen",
        "dense_layers": None,
        "router_aux_loss_coef": _router_loss(read),
    }


def _gpt_oss_windows(config: Mapping[str, Any], read) -> dict[str, Any]:
    """`layer_types` as given, else transformers' default (sliding layers at even indices);
    `sliding_window` for the sliding ones, which a config with sliding layers must give."""
    depth = int(read("num_hidden_layers"))
    if config.get("layer_types") is not None:
        kinds = _checked_layer_types(config["layer_types"], read)
    else:
        kinds = [SLIDING if i % 2 == 0 else FULL for i in range(depth)]
    window = read("sliding_window")
    if SLIDING not in kinds:
        return {"sliding_window": 0, "layer_types": kinds}
    if not window:
        raise ZooError(
            f"This gpt_oss config has sliding_window={window!r} and sliding layers "
            f"(layer_types={kinds!r}): give the window's length in positions, or make every "
            "layer full_attention."
        )
    return {"sliding_window": int(window), "layer_types": kinds}


def _gpt_oss_export(hparams: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "hidden_act": "silu",
        "attention_bias": hparams["qkv_bias"],
        "sliding_window": hparams["sliding_window"] or None,
        "layer_types": list(hparams["layer_types"]),
        "rope_parameters": _rope_parameters(hparams),
        "num_local_experts": _experts_to_export(hparams, "gpt_oss", "llama"),
        "num_experts_per_tok": hparams["experts_per_token"],
        "intermediate_size": hparams["expert_mlp_dim"],
        "swiglu_limit": hparams["swiglu_limit"],
        "swiglu_alpha": hparams["swiglu_alpha"],
        **_router_loss_export(hparams),
    }


def _deepseek_v3_options(config: Mapping[str, Any], read: Callable[[str], Any]) -> dict[str, Any]:
    """DeepSeek V3: multi-head latent attention (every query head its own key and value, from
    the shared latent), the rotary features interleaved with `rope_interleave`, YaRN's
    `mscale_all_dim` scaling the softmax too; the first `first_k_dense_replace` layers' MLP
    dense, the others' a mixture of `n_routed_experts` routed by sigmoid scores with a
    correction bias, within the `topk_group` best of `n_group` groups, weighted by
    `routed_scaling_factor`, beside `n_shared_experts` shared ones."""
    _check_deepseek_v3(config, read)
    rope = _global_rope(config, read)
    nope, rotated = int(read("qk_nope_head_dim")), int(read("qk_rope_head_dim"))
    mscale_all_dim = (config.get("rope_scaling") or config.get("rope_parameters") or {}).get(
        "mscale_all_dim"
    )
    depth, dense = int(read("num_hidden_layers")), int(read("first_k_dense_replace") or 0)
    return {
        "activation": _activation(read, "hidden_act"),
        **rope,
        "head_dim": nope + rotated,
        "kv_lora_rank": int(read("kv_lora_rank")),
        "q_lora_rank": int(read("q_lora_rank") or 0),
        "rope_head_dim": rotated,
        "value_head_dim": int(read("v_head_dim")),
        "rope_interleaved": bool(read("rope_interleave")),
        "rope_mscale_all_dim": float(mscale_all_dim or 0.0) if rope["rope_type"] == "yarn" else 0.0,
        "num_experts": int(config.get("num_local_experts", read("n_routed_experts"))),
        "experts_per_token": int(read("num_experts_per_tok")),
        "expert_mlp_dim": int(read("moe_intermediate_size")),
        "normalize_expert_weights": bool(read("norm_topk_prob")),
        "router_softmax": "sigmoid",
        "router_groups": int(read("n_group") or 1),
        "router_groups_kept": int(read("topk_group") or 1),
        "expert_weight_scale": float(read("routed_scaling_factor")),
        "shared_expert_mlp_dim": int(read("n_shared_experts") or 0)
        * int(read("moe_intermediate_size")),
        "dense_layers": list(range(min(dense, depth))) or None,
        "router_aux_loss_coef": 0.0,
    }


_DEEPSEEK_HUB_VALUES = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}
"""Keys of the hub's DeepSeek V3 configs (read by its own modeling code, not transformers')
at the one value transformers computes: another would be silently ignored."""


def _check_deepseek_v3(config: Mapping[str, Any], read: Callable[[str], Any]) -> None:
    """Refuse what transformers' DeepseekV3ForCausalLM cannot compute or ignores, by name."""
    heads, kv_heads = read("num_attention_heads"), read("num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        raise ZooError(
            f"This deepseek_v3 config has num_key_value_heads={kv_heads} and "
            f"num_attention_heads={heads}: latent attention projects a key and a value for every "
            "query head from the shared latent (transformers fails on grouped heads there). "
            "Give num_key_value_heads equal to num_attention_heads."
        )
    if read("attention_bias"):
        raise ZooError(
            "This deepseek_v3 config has attention_bias=true (biases on q_a_proj, "
            "kv_a_proj_with_mqa and o_proj); decoder's latent attention has none: "
            "attention_bias false only."
        )
    for key, value in _DEEPSEEK_HUB_VALUES.items():
        if key in config and config[key] != value:
            raise ZooError(
                f"This deepseek_v3 config has {key}={config[key]!r}, which transformers' "
                f"DeepseekV3ForCausalLM does not read: it computes {key}={value!r} whatever "
                "the config says, as decoder does. A checkpoint trained otherwise is not "
                "DeepSeek V3's; give its own model_type."
            )


def _deepseek_v3_export(hparams: Mapping[str, Any]) -> dict[str, Any]:
    if not hparams.get("kv_lora_rank"):
        raise ZooError(
            "The deepseek_v3 layout (DeepseekV3ForCausalLM) cannot hold this model: it holds "
            "multi-head latent attention, and this model has grouped-query attention "
            "(model.kv_lora_rank=0). Export it to llama, or qwen3_moe for experts."
        )
    count = _experts_to_export(hparams, "deepseek_v3", "llama")
    width = hparams["expert_mlp_dim"]
    shared, remainder = divmod(hparams["shared_expert_mlp_dim"], width)
    if remainder:
        raise ZooError(
            f"The deepseek_v3 layout cannot hold model.shared_expert_mlp_dim="
            f"{hparams['shared_expert_mlp_dim']}: it holds n_shared_experts experts of "
            f"moe_intermediate_size={width} each, a multiple of it."
        )
    dense = list(hparams["dense_layers"] or ())
    rope = _rope_parameters(hparams)
    if hparams["rope_mscale_all_dim"]:
        rope["mscale_all_dim"] = hparams["rope_mscale_all_dim"]
    return {
        "hidden_act": _hidden_act(hparams),
        "attention_bias": False,
        "head_dim": hparams["rope_head_dim"],  # as transformers writes it (its rotary width)
        "q_lora_rank": hparams["q_lora_rank"] or None,
        "kv_lora_rank": hparams["kv_lora_rank"],
        "qk_rope_head_dim": hparams["rope_head_dim"],
        "qk_nope_head_dim": hparams["head_dim"] - hparams["rope_head_dim"],
        "v_head_dim": hparams["value_head_dim"],
        "rope_interleave": hparams["rope_interleaved"],
        "rope_parameters": rope,
        "n_routed_experts": count,
        "num_experts_per_tok": hparams["experts_per_token"],
        "moe_intermediate_size": width,
        "n_shared_experts": shared,
        "norm_topk_prob": hparams["normalize_expert_weights"],
        "n_group": hparams["router_groups"],
        "topk_group": hparams["router_groups_kept"],
        "routed_scaling_factor": hparams["expert_weight_scale"],
        "first_k_dense_replace": len(dense),
        "num_nextn_predict_layers": 0,
    }


def _experts_to_export(hparams: Mapping[str, Any], kind: str, dense: str) -> int:
    """The model's experts per layer; a model without any is refused (it is a `dense` one)."""
    if not hparams.get("num_experts"):
        architecture = next(k.architecture for k in KINDS if k.name == kind)
        raise ZooError(
            f"The {kind} layout ({architecture}) cannot hold this model: it holds "
            "mixtures of experts, and "
            f"this model has none (model.num_experts=0). Export it to a dense family, such as "
            f"{dense}."
        )
    return int(hparams["num_experts"])


def _expert_count(config: Mapping[str, Any], read) -> int:
    """`num_experts` (transformers 4, and the hub's Qwen3-MoE) or `num_local_experts` (5)."""
    return int(config["num_experts"] if "num_experts" in config else read("num_local_experts"))


def _router_loss(read: Callable[[str], Any]) -> float:
    """The load-balancing loss's weight: transformers adds it to the training loss where
    output_router_logits is true."""
    return float(read("router_aux_loss_coef")) if read("output_router_logits") else 0.0


def _router_loss_export(hparams: Mapping[str, Any]) -> dict[str, Any]:
    coef = float(hparams.get("router_aux_loss_coef") or 0.0)
    return {
        "output_router_logits": coef > 0,
        "router_aux_loss_coef": coef or _MOE_DEFAULTS["router_aux_loss_coef"],
    }


def _mistral_options(config: Mapping[str, Any], read: Callable[[str], Any]) -> dict[str, Any]:
    if "layer_types" in config:
        raise ZooError(
            f"This mistral config has layer_types={config['layer_types']!r}, which "
            "transformers' MistralForCausalLM does not read (every layer of a Mistral sees the "
            "same sliding_window): a checkpoint of alternating layers is not a mistral one. "
            "Remove the key, or give the model_type of the architecture it was trained as."
        )
    return {
        "activation": _activation(read, "hidden_act"),
        "sliding_window": int(read("sliding_window") or 0),
        **_global_rope(config, read),
    }


def _mistral_export(hparams: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "hidden_act": _hidden_act(hparams),
        "sliding_window": hparams["sliding_window"] or None,
        "rope_parameters": _rope_parameters(hparams),
    }


def _gemma3_options(config: Mapping[str, Any], read: Callable[[str], Any]) -> dict[str, Any]:
    if read("use_bidirectional_attention"):
        raise ZooError(
            "This gemma3_text config has use_bidirectional_attention=true (an encoder: every "
            "token sees the ones after it); decoder is causal and loads "
            "use_bidirectional_attention=false only."
        )
    if read("attn_logit_softcapping") is not None:
        raise ZooError(
            f"This gemma3_text config has attn_logit_softcapping="
            f"{read('attn_logit_softcapping')!r}, which transformers' Gemma3ForCausalLM does not "
            "apply (Gemma 3 has no soft-capping of attention; Gemma 2 had): whether the "
            "checkpoint was trained with it cannot be told. decoder loads "
            "attn_logit_softcapping=null."
        )
    bias = bool(read("attention_bias"))
    full, sliding = _gemma3_ropes(config, read)
    if sliding["rope_type"] != "default":
        raise ZooError(
            f"This gemma3_text config scales the RoPE of its sliding layers "
            f"(rope_type={sliding['rope_type']!r} for sliding_attention); decoder scales the "
            "global layers' only: the sliding layers' RoPE must be rope_type 'default'."
        )
    return {
        "activation": _activation(read, "hidden_activation"),
        "norm_unit_offset": True,
        "post_norms": True,
        "qk_norm": True,
        "embed_scale": True,
        "qkv_bias": bias,
        "out_bias": bias,
        "query_scale": float(read("query_pre_attn_scalar")),
        "final_softcap": float(read("final_logit_softcapping") or 0.0),
        **_rope(full, "rope_parameters.full_attention", read),
        "local_rope_theta": float(sliding["rope_theta"]),
        "sliding_window": int(read("sliding_window") or 0),
        "layer_types": _gemma3_layer_types(config, read),
    }


def _gemma3_export(hparams: Mapping[str, Any]) -> dict[str, Any]:
    global_rope = _rope_parameters(hparams)
    local_theta = hparams["local_rope_theta"] or global_rope["rope_theta"]
    return {
        "hidden_activation": _hidden_act(hparams),
        "attention_bias": hparams["qkv_bias"],
        "query_pre_attn_scalar": int(hparams["query_scale"]),
        "attn_logit_softcapping": None,
        "final_logit_softcapping": hparams["final_softcap"] or None,
        "sliding_window": hparams["sliding_window"] or None,
        "layer_types": list(hparams["layer_types"]),
        "rope_parameters": {
            FULL: global_rope,
            SLIDING: {"rope_type": "default", "rope_theta": local_theta},
        },
        "use_bidirectional_attention": False,
    }


def _gemma3_ropes(config: Mapping[str, Any], read) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global, local) RoPE dicts of a Gemma 3 config in either layout, as transformers 5's
    `Gemma3TextConfig.convert_rope_params_to_dict` merges them."""
    nested = config.get("rope_parameters") or {}
    if nested and not set(nested) <= {FULL, SLIDING}:
        raise ZooError(
            f"This gemma3_text config has rope_parameters={nested!r}; transformers 5 writes one "
            f"dict per layer type there, under {FULL!r} and {SLIDING!r}."
        )
    full = dict(nested.get(FULL) or {"rope_type": "default"})
    full.update(config.get("rope_scaling") or {})
    full.setdefault("rope_theta", config.get("rope_theta", 1_000_000.0))
    sliding = dict(nested.get(SLIDING) or {"rope_type": "default"})
    sliding.setdefault("rope_theta", config.get("rope_local_base_freq", DEFAULT_THETA))
    for rope, where in ((full, FULL), (sliding, SLIDING)):
        rope.setdefault("rope_type", rope.get("type", "default"))
        _check_rope(rope, f"rope_parameters.{where}", read)
    return full, sliding


def _gemma3_layer_types(config: Mapping[str, Any], read) -> list[str]:
    """`layer_types` as given (transformers 5), else from `sliding_window_pattern` (4): every
    pattern-th layer global, the others sliding."""
    if config.get("layer_types") is not None:
        return _checked_layer_types(config["layer_types"], read)
    pattern = int(config.get("sliding_window_pattern", 6))
    return [SLIDING if (i + 1) % pattern else FULL for i in range(read("num_hidden_layers"))]


def _qwen_windows(config: Mapping[str, Any], read) -> dict[str, Any]:
    """Qwen's sliding windows as transformers 5 reads them: none unless `use_sliding_window`;
    then on the layers `layer_types` names, or (a transformers 4 config) on layers
    `max_window_layers` and above."""
    window = read("sliding_window") if read("use_sliding_window") else None
    if window is None:
        return {"sliding_window": 0, "layer_types": None}
    if config.get("layer_types") is not None:
        kinds = _checked_layer_types(config["layer_types"], read)
    else:
        first = read("max_window_layers")
        kinds = [SLIDING if i >= first else FULL for i in range(read("num_hidden_layers"))]
    return {"sliding_window": int(window), "layer_types": kinds}


def _qwen_windows_config(hparams: Mapping[str, Any]) -> dict[str, Any]:
    kinds = list(hparams["layer_types"])
    sliding = [i for i, kind in enumerate(kinds) if kind == SLIDING]
    return {
        "use_sliding_window": bool(sliding),
        "sliding_window": hparams["sliding_window"] or None,
        "max_window_layers": sliding[0] if sliding else hparams["depth"],
        "layer_types": kinds,
    }


def _checked_layer_types(kinds: Any, read) -> list[str]:
    depth = read("num_hidden_layers")
    if not isinstance(kinds, list) or len(kinds) != depth or not set(kinds) <= {FULL, SLIDING}:
        raise ZooError(
            f"This config has layer_types={kinds!r}; decoder loads one of {FULL!r} or "
            f"{SLIDING!r} for each of its num_hidden_layers={depth} layers."
        )
    return list(kinds)


def _global_rope(config: Mapping[str, Any], read) -> dict[str, Any]:
    """The RoPE of a config with one for every layer, as transformers 5's
    `convert_rope_params_to_dict` and `standardize_rope_params` read it: `rope_scaling`
    (transformers 4) over `rope_parameters` (5), `rope_theta` from the dict, else the top
    level, else the family's default (Mixtral's 1e6, the others' 1e4)."""
    given = config.get("rope_scaling") or config.get("rope_parameters") or {}
    where = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    if not isinstance(given, dict) or not all(
        isinstance(v, (int, float, str)) for v in given.values()
    ):
        raise ZooError(
            f"This {config.get('model_type')} config has {where}={given!r}; decoder reads one "
            "dict of RoPE parameters (rope_type, rope_theta, factor, ...) for every layer."
        )
    rope = dict(given)
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope.setdefault("rope_theta", read("rope_theta") or DEFAULT_THETA)
    _check_rope(rope, where, read)
    return _rope(rope, where, read)


def _check_rope(rope: Mapping[str, Any], where: str, read) -> None:
    kind = rope["rope_type"]
    if kind not in ROPE_TYPES:
        raise ZooError(
            f"This config's {where}.rope_type is {kind!r}; decoder implements the RoPE "
            f"scalings {', '.join(map(repr, ROPE_TYPES))}."
        )
    unknown = sorted(set(rope) - _ROPE_KEYS[kind])
    if unknown:
        raise ZooError(
            f"This config's {where} has {', '.join(f'{k}={rope[k]!r}' for k in unknown)}, "
            f"which decoder does not read for rope_type {kind!r} (it reads "
            f"{', '.join(sorted(_ROPE_KEYS[kind]))})."
        )
    partial = rope.get("partial_rotary_factor", read("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise ZooError(
            f"This config has partial_rotary_factor={partial!r} (RoPE on part of each head); "
            "decoder rotates whole heads: partial_rotary_factor 1.0 only."
        )


def _rope(rope: Mapping[str, Any], where: str, read) -> dict[str, Any]:
    """`decoder`'s RoPE arguments of a checked RoPE dict."""
    kind = rope["rope_type"]
    out = {"rope_theta": float(rope["rope_theta"]), "rope_type": kind, "rope_factor": 1.0}
    if kind in ("linear", "llama3"):
        out["rope_factor"] = float(_required(rope, "factor", where))
    if kind == "llama3":
        context = read("original_max_position_embeddings")
        if context is None:
            context = rope.get("original_max_position_embeddings", read("max_position_embeddings"))
        out.update(
            rope_low_freq_factor=float(_required(rope, "low_freq_factor", where)),
            rope_high_freq_factor=float(_required(rope, "high_freq_factor", where)),
            rope_original_context=int(context),
        )
    if kind == "yarn":
        out.update(_yarn(rope, where, read))
    return out


def _yarn(rope: Mapping[str, Any], where: str, read) -> dict[str, Any]:
    """YaRN's arguments as transformers' `_compute_yarn_parameters` reads them: the original
    context (a top-level `original_max_position_embeddings` first, as transformers 5 moves it
    into the dict), `factor` (null: the contexts' ratio), `beta_fast` and `beta_slow` (null or
    0: 32 and 1), `truncate` (absent: true) and the attention factor: `attention_factor`, else
    DeepSeek's `mscale` over `mscale_all_dim` where both are given, else 0 (`decoder` derives
    it from the factor, as transformers does)."""
    context = read("original_max_position_embeddings")
    if context is None:
        context = _required(rope, "original_max_position_embeddings", where)
    factor = rope.get("factor")
    if factor is None:
        factor = read("max_position_embeddings") / context
    attention = rope.get("attention_factor")
    mscale, all_dims = rope.get("mscale"), rope.get("mscale_all_dim")
    if attention is None and mscale and all_dims:
        attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dims)
    return {
        "rope_factor": float(factor),
        "rope_original_context": int(context),
        "rope_beta_fast": float(rope.get("beta_fast") or 32.0),
        "rope_beta_slow": float(rope.get("beta_slow") or 1.0),
        "rope_truncate": bool(rope.get("truncate", True)),
        "rope_attention_factor": float(attention or 0.0),
    }


def _required(rope: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in rope:
        raise ZooError(
            f"This config's {where} has rope_type {rope['rope_type']!r} but no {key}, which "
            "that scaling needs."
        )
    return rope[key]


def _rope_parameters(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """The global layers' RoPE in transformers 5's `rope_parameters` form."""
    rope = {"rope_type": hparams["rope_type"], "rope_theta": hparams["rope_theta"]}
    if hparams["rope_type"] in ("linear", "llama3", "yarn"):
        rope["factor"] = hparams["rope_factor"]
    if hparams["rope_type"] == "yarn":
        rope.update(
            original_max_position_embeddings=hparams["rope_original_context"],
            beta_fast=hparams["rope_beta_fast"],
            beta_slow=hparams["rope_beta_slow"],
            truncate=hparams["rope_truncate"],
        )
        if hparams["rope_attention_factor"]:
            rope["attention_factor"] = hparams["rope_attention_factor"]
    if hparams["rope_type"] == "llama3":
        rope.update(
            low_freq_factor=hparams["rope_low_freq_factor"],
            high_freq_factor=hparams["rope_high_freq_factor"],
            original_max_position_embeddings=hparams["rope_original_context"],
        )
    return rope


def _activation(read, key: str) -> str:
    value = read(key)
    if value in _SILU:
        return "silu"
    if value in _TANH_GELU:
        return "gelu_tanh"
    raise ZooError(
        f"This config has {key}={value!r}; decoder's gated MLP takes SiLU "
        f"({', '.join(_SILU)}) or the tanh approximation of GELU ({', '.join(_TANH_GELU)})."
    )


def _hidden_act(hparams: Mapping[str, Any]) -> str:
    return "silu" if hparams["activation"] == "silu" else "gelu_pytorch_tanh"


def _hparams(kind: _Kind) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    def hparams(config: Mapping[str, Any]) -> dict[str, Any]:
        def read(key: str) -> Any:
            """The key's value (null included, as transformers takes it), else the default."""
            return config[key] if key in config else kind.defaults.get(key)

        quantization = config.get("quantization_config")
        if quantization is not None:
            _check_quantized(kind, quantization or {})
        dim, heads = int(read("hidden_size")), int(read("num_attention_heads"))
        kv_heads = int(read("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ZooError(
                f"This {kind.name} config has num_attention_heads={heads} and "
                f"num_key_value_heads={kv_heads}; the query heads must be a multiple of the "
                "key/value heads."
            )
        return {
            "vocab_size": int(read("vocab_size")),
            "context_length": int(read("max_position_embeddings")),
            "dim": dim,
            "depth": int(read("num_hidden_layers")),
            "num_heads": heads,
            "num_kv_heads": kv_heads,
            "head_dim": int(read("head_dim") or dim // heads),
            "mlp_dim": int(read("intermediate_size")),
            "norm_epsilon": float(read("rms_norm_eps")),
            "tie_embeddings": bool(read("tie_word_embeddings")),
            **_PLAIN,
            **kind.options(config, read),
        }

    return hparams


def _check_quantized(kind: _Kind, quantization: Mapping[str, Any]) -> None:
    """Refuse a quantized checkpoint by its method unless the family decodes it at load
    (gpt-oss's MXFP4 experts): `decoder` loads float weights."""
    method = quantization.get("quant_method")
    methods = sorted({combine.quant_method for combine in kind.quantized})
    if method in methods:
        return
    read = f" or, quantized, with quant_method {', '.join(map(repr, methods))}" if methods else ""
    raise ZooError(
        f"This {kind.name} checkpoint is quantized (quantization_config with "
        f"quant_method={method!r}); decoder loads {kind.name} checkpoints in float32, bfloat16 "
        f"or float16{read}. Load the checkpoint it was quantized from."
    )


_PLAIN = {
    "num_experts": 0,
    "dense_layers": None,
    "norm_unit_offset": False,
    "post_norms": False,
    "qk_norm": False,
    "qkv_bias": False,
    "out_bias": False,
    "mlp_bias": False,
    "local_rope_theta": 0.0,
    "sliding_window": 0,
    "layer_types": None,
    "query_scale": 0.0,
    "attention_softcap": 0.0,
    "final_softcap": 0.0,
    "embed_scale": False,
    "attention_sinks": False,
    "router_bias": False,
    "router_softmax": "all",
    "router_groups": 1,
    "router_groups_kept": 1,
    "expert_weight_scale": 1.0,
    "shared_expert_mlp_dim": 0,
    "kv_lora_rank": 0,
    "q_lora_rank": 0,
    "rope_head_dim": 0,
    "value_head_dim": 0,
    "rope_interleaved": False,
    "rope_mscale_all_dim": 0.0,
}
"""The options of a plain Llama: what a family does not set stays at these."""


def _export_config(kind: _Kind) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    def export_config(hparams: Mapping[str, Any]) -> dict[str, Any]:
        hparams = _effective(hparams)
        config = {
            "architectures": [kind.architecture],
            "model_type": kind.name,
            "vocab_size": hparams["vocab_size"],
            "max_position_embeddings": hparams["context_length"],
            "hidden_size": hparams["dim"],
            "num_hidden_layers": hparams["depth"],
            "num_attention_heads": hparams["num_heads"],
            "num_key_value_heads": hparams["num_kv_heads"],
            "head_dim": hparams["head_dim"],
            "intermediate_size": hparams["mlp_dim"],
            "rms_norm_eps": hparams["norm_epsilon"],
            "tie_word_embeddings": hparams["tie_embeddings"],
            "attention_dropout": 0.0,
            "use_cache": True,
            **kind.export(hparams),
        }
        config.update(_transformers_4_keys(config))
        _check_expressed(kind, hparams, config)
        return config

    return export_config


def _transformers_4_keys(config: Mapping[str, Any]) -> dict[str, Any]:
    """What transformers 4 reads in place of `rope_parameters`, from it: RoPE's base and
    scaling at the top level (`rope_theta`; `rope_scaling`, null for the default rotation);
    for Gemma 3 the global layers' there, the local layers' base as `rope_local_base_freq`,
    and `sliding_window_pattern` where the layers follow one (transformers before 4.53 derives
    the layers from it). Written beside transformers 5's keys, which read the same model, so
    that transformers 4, and the tools that read a config as it wrote them (vLLM among them),
    do not fall back to their defaults."""
    rope, keys = config["rope_parameters"], {}
    if FULL in rope:  # Gemma 3: one per layer type
        keys["rope_local_base_freq"] = rope[SLIDING]["rope_theta"]
        pattern = _sliding_window_pattern(config["layer_types"])
        if pattern:
            keys["sliding_window_pattern"] = pattern
        rope = rope[FULL]
    scaling = {key: value for key, value in rope.items() if key != "rope_theta"}
    keys["rope_theta"] = rope["rope_theta"]
    keys["rope_scaling"] = None if scaling == {"rope_type": "default"} else scaling
    return keys


def _sliding_window_pattern(kinds: list[str]) -> int | None:
    """Gemma 3's `sliding_window_pattern` for `kinds`: every pattern-th layer global, the
    others sliding (as `_gemma3_layer_types` reads it); None where they follow none."""
    if FULL not in kinds:
        return None
    pattern = kinds.index(FULL) + 1
    derived = [SLIDING if (i + 1) % pattern else FULL for i in range(len(kinds))]
    return pattern if derived == kinds else None


_OPTIONS = tuple(field.name for field in dataclasses.fields(DecoderOptions))


def _effective(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """`decoder`'s arguments with each 0 or null that stands for a default made explicit (as
    `DecoderOptions.resolved` makes them, and the layouts write them), so that a model built
    with defaults compares with a checkpoint's."""
    h = {**_PLAIN, **hparams}
    options = DecoderOptions(**{key: h[key] for key in _OPTIONS if key in h}).resolved()
    resolved = ("num_kv_heads", "head_dim", "mlp_dim", "layer_types", "dense_layers")
    for key in (*resolved, "value_head_dim"):
        h[key] = getattr(options, key)
    h["expert_mlp_dim"] = options.expert_mlp_dim if options.num_experts else 0
    if SLIDING not in h["layer_types"]:
        h["sliding_window"] = 0
    h["query_scale"] = float(h["query_scale"] or h["head_dim"])
    if not h["local_rope_theta"] and h.get("rope_type", "default") == "default":
        h["local_rope_theta"] = h.get("rope_theta", DEFAULT_THETA)
    return h


def _check_expressed(kind: _Kind, hparams: Mapping[str, Any], config: dict[str, Any]) -> None:
    """Refuse to write a config that reads back as another model than `hparams`' (a setting
    the family's layout cannot hold), naming each setting."""
    back = _effective(_hparams(kind)(config))
    differ = [
        f"{key}={hparams.get(key)!r} (the layout gives {value!r})"
        for key, value in back.items()
        if key in hparams and hparams[key] != value
    ]
    if differ:
        raise ZooError(
            f"The {kind.name} layout ({kind.architecture}) cannot hold this model: "
            f"{'; '.join(differ)}. Export it to a family that has these settings."
        )


def _rules(kind: _Kind) -> Callable[[Mapping[str, Any]], list[Rule]]:
    def rules(hparams: Mapping[str, Any]) -> list[Rule]:
        dim, vocab = hparams["dim"], hparams["vocab_size"]
        heads, head_dim = hparams["num_heads"], hparams["head_dim"] or dim // hparams["num_heads"]
        kv_heads = hparams["num_kv_heads"] or heads
        pad = padded_vocab(vocab) - vocab
        experts = _EXPERT_KEYS.get(kind.name) if hparams.get("num_experts") else None
        stacked = kind.name == "gpt_oss" and hparams.get("num_experts")
        latent = hparams.get("kv_lora_rank")
        attention = (
            _latent_rules(hparams, dim, heads, head_dim)
            if latent
            else _attention_rules(dim, heads, kv_heads, head_dim)
        )
        deepseek = kind.name == "deepseek_v3" and hparams.get("num_experts")
        return [
            *_core_rules(pad, attention),
            *(_deepseek_expert_rules(hparams) if deepseek else ()),
            *_norm_rules(gemma=kind.name == "gemma3_text"),
            *_optional_rules(hparams, heads, kv_heads, head_dim, pad),
            *(_expert_rules(*experts) if experts else ()),
            *(_stacked_expert_rules() if stacked else ()),
        ]

    return rules


def _core_rules(pad: int, attention: list[Rule]) -> list[Rule]:
    """The rules of the params every family has: the embedding (`pad` rows added), the final
    norm, and each layer's input norm, `attention`'s projections and MLP kernels."""
    return [
        _rule("model.embed_tokens.weight", "embedding", pad_rows=pad),
        _rule("model.norm.weight", "norm.scale"),
        _layer("input_layernorm.weight", "attention_norm.scale"),
        *attention,
        *[_layer(f"mlp.{name}_proj.weight", f"mlp.{name}.kernel") for name in MLP],
    ]


def _attention_rules(dim: int, heads: int, kv_heads: int, head_dim: int) -> list[Rule]:
    """Grouped-query attention's q/k/v/o projections."""
    return [
        _projection("q_proj", "query", heads, head_dim, dim),
        _projection("k_proj", "key", kv_heads, head_dim, dim),
        _projection("v_proj", "value", kv_heads, head_dim, dim),
        _output_projection(dim, heads, head_dim),
    ]


def _output_projection(dim: int, heads: int, head_dim: int) -> Rule:
    """o: torch's (dim, heads * head_dim) <-> (dim, heads, head_dim), a reshape."""
    return _layer(
        "self_attn.o_proj.weight",
        "attention.out.kernel",
        load=lambda w: (w.reshape(dim, heads, head_dim),),
        save=lambda kernel: kernel.reshape(dim, heads * head_dim),
    )


def _latent_rules(hparams: Mapping[str, Any], dim: int, heads: int, head_dim: int) -> list[Rule]:
    """Latent attention's (DeepSeek V3's): the query's projection, or its down projection,
    norm and up projection (`q_lora_rank`); the keys' and values' down projection (latent and
    rotated key together, as the checkpoint stores them), the latent's norm and its up
    projection to every head's unrotated key and value; the output projection."""
    rank, q_rank = hparams["kv_lora_rank"], hparams.get("q_lora_rank")
    nope = head_dim - hparams["rope_head_dim"]
    value = hparams.get("value_head_dim") or head_dim
    query = [_projection("q_proj", "query", heads, head_dim, dim)]
    if q_rank:
        query = [
            _layer("self_attn.q_a_proj.weight", "attention.query_down.kernel"),
            _layer("self_attn.q_a_layernorm.weight", "attention.query_down_norm.scale"),
            _projection("q_b_proj", "query", heads, head_dim, q_rank),
        ]
    return [
        *query,
        _layer("self_attn.kv_a_proj_with_mqa.weight", "attention.kv_down.kernel"),
        _layer("self_attn.kv_a_layernorm.weight", "attention.kv_norm.scale"),
        _projection("kv_b_proj", "kv_up", heads, nope + value, rank),
        _output_projection(dim, heads, value),
    ]


def _deepseek_expert_rules(hparams: Mapping[str, Any]) -> list[Rule]:
    """DeepSeek V3's router's correction bias, and its shared experts' gated MLP."""
    rules = [_layer("mlp.gate.e_score_correction_bias", "mlp.router.correction_bias")]
    if hparams.get("shared_expert_mlp_dim"):
        rules += [
            _layer(f"mlp.shared_experts.{name}_proj.weight", f"mlp.shared.{name}.kernel")
            for name in MLP
        ]
    return rules


def _norm_rules(gemma: bool) -> list[Rule]:
    """The rules of the norms around each layer's MLP: Gemma 3's three (after attention, before
    and after the MLP), or the one the others hold before the MLP."""
    if gemma:
        return [
            _layer("post_attention_layernorm.weight", "post_attention_norm.scale"),
            _layer("pre_feedforward_layernorm.weight", "mlp_norm.scale"),
            _layer("post_feedforward_layernorm.weight", "post_mlp_norm.scale"),
        ]
    return [_layer("post_attention_layernorm.weight", "mlp_norm.scale")]


def _optional_rules(
    hparams: Mapping[str, Any], heads: int, kv_heads: int, head_dim: int, pad: int
) -> list[Rule]:
    """The rules of the params that `hparams` may add: query/key norms, biases, and the output
    layer of untied embeddings."""
    table = []
    if hparams.get("qk_norm"):
        table += [
            _layer("self_attn.q_norm.weight", "attention.query_norm.scale"),
            _layer("self_attn.k_norm.weight", "attention.key_norm.scale"),
        ]
    if hparams.get("qkv_bias"):
        table += [
            _bias("q_proj", "query", heads, head_dim),
            _bias("k_proj", "key", kv_heads, head_dim),
            _bias("v_proj", "value", kv_heads, head_dim),
        ]
    if hparams.get("out_bias"):
        table.append(_layer("self_attn.o_proj.bias", "attention.out.bias"))
    if hparams.get("mlp_bias"):
        table += [_layer(f"mlp.{n}_proj.bias", f"mlp.{n}.bias") for n in MLP]
    if hparams.get("attention_sinks"):
        table.append(_layer("self_attn.sinks", "attention.sinks"))
    if not hparams.get("tie_embeddings", True):
        table.append(_rule("lm_head.weight", "unembed.kernel", pad_rows=pad))
    return table


def _expert_rules(block: str, names: Mapping[str, str]) -> list[Rule]:
    """The rules of a mixture-of-experts layer: its router, `model.layers.N.<block>.gate`,
    and expert E's projections, `<block>.experts.E.<name>.weight` (`names`: the gated MLP's
    gate, up and down), each expert one slice of the stacked kernel (`_stacked`)."""
    expert = rf"model\.layers\.(\d+)\.{block}\.experts\.(\d+)\."
    return [
        _layer(f"{block}.gate.weight", "mlp.router.kernel"),
        *[
            Rule(
                expert + names[param].replace(".", r"\.") + r"\.weight",
                (rf"layers.\1.mlp.experts.\2.{param}",),
                export_key=rf"model.layers.\1.{block}.experts.\2.{names[param]}.weight",
            )
            for param in MLP
        ],
    ]


MXFP4_EXPERTS = Combine(
    r"model\.layers\.\d+\.mlp\.experts\.(?:gate_up|down)_proj",
    ("_blocks", "_scales"),
    "mxfp4",
    mxfp4_shape,
    dequantize_mxfp4,
)
"""gpt-oss's hub files (`quantization_config` with `quant_method: mxfp4`): each layer's
`gate_up_proj` and `down_proj` stored as MXFP4 `_blocks` and `_scales`, decoded at load into
the stacked layout of `_stacked_expert_rules`, as transformers' `Mxfp4Config(dequantize=True)`
decodes them."""


def _stacked_expert_rules() -> list[Rule]:
    """gpt-oss's experts, stored stacked as transformers 5 holds them: `gate_up_proj`
    [experts, dim, 2 x hidden] (inputs first, the gate's and up's outputs interleaved: gate
    the even columns, up the odd), `down_proj` [experts, hidden, dim], their biases, and the
    router's weight and bias; each kernel transposed to `decoder`'s (outputs, inputs)."""
    return [
        _layer("mlp.router.weight", "mlp.router.kernel"),
        _layer("mlp.router.bias", "mlp.router.bias"),
        Rule(
            r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj",
            (r"layers.\1.mlp.experts.gate", r"layers.\1.mlp.experts.up"),
            load=lambda w: (w[..., ::2].transpose(0, 2, 1), w[..., 1::2].transpose(0, 2, 1)),
            save=lambda gate, up: _interleaved(gate.transpose(0, 2, 1), up.transpose(0, 2, 1)),
            export_key=r"model.layers.\1.mlp.experts.gate_up_proj",
        ),
        Rule(
            r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj_bias",
            (r"layers.\1.mlp.experts.gate_bias", r"layers.\1.mlp.experts.up_bias"),
            load=lambda b: (b[..., ::2], b[..., 1::2]),
            save=_interleaved,
            export_key=r"model.layers.\1.mlp.experts.gate_up_proj_bias",
        ),
        _layer(
            "mlp.experts.down_proj",
            "mlp.experts.down",
            load=lambda w: (w.transpose(0, 2, 1),),
            save=lambda kernel: kernel.transpose(0, 2, 1),
        ),
        _layer("mlp.experts.down_proj_bias", "mlp.experts.down_bias"),
    ]


def _interleaved(even: np.ndarray, odd: np.ndarray) -> np.ndarray:
    """`even` and `odd` [..., n] as one [..., 2n] array, taking turns along the last axis."""
    return np.stack([even, odd], axis=-1).reshape(*even.shape[:-1], -1)


MLP = ("gate", "up", "down")
_EXPERT_KEYS = {
    "qwen3_moe": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
    "mixtral": ("block_sparse_moe", {"gate": "w1", "up": "w3", "down": "w2"}),
    "deepseek_v3": ("mlp", {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}),
}
"""Per mixture-of-experts family: the layer's block of experts, and each expert's names of
the gated MLP's projections."""


def _rule(key: str, param: str, **transform: Any) -> Rule:
    return Rule(key.replace(".", r"\."), (param,), export_key=key, **transform)


def _layer(key: str, param: str, **transform: Any) -> Rule:
    """A rule of every layer's `model.layers.N.<key>` -> `layers.N.<param>`."""
    return Rule(
        r"model\.layers\.(\d+)\." + key.replace(".", r"\."),
        (rf"layers.\1.{param}",),
        export_key=rf"model.layers.\1.{key}",
        **transform,
    )


def _projection(name: str, param: str, heads: int, head_dim: int, dim: int) -> Rule:
    """q/k/v: torch's (heads * head_dim, dim) <-> (heads, head_dim, dim), a reshape."""
    return _layer(
        f"self_attn.{name}.weight",
        f"attention.{param}.kernel",
        load=lambda w: (w.reshape(heads, head_dim, dim),),
        save=lambda kernel: kernel.reshape(heads * head_dim, dim),
    )


def _bias(name: str, param: str, heads: int, head_dim: int) -> Rule:
    return _layer(
        f"self_attn.{name}.bias",
        f"attention.{param}.bias",
        load=lambda b: (b.reshape(heads, head_dim),),
        save=lambda bias: bias.reshape(heads * head_dim),
    )


_LLAMA_DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
}
_QWEN_DEFAULTS = {
    **_LLAMA_DEFAULTS,
    "vocab_size": 151936,
    "intermediate_size": 22016,
    "num_key_value_heads": 32,
    "max_position_embeddings": 32768,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
}
_QWEN3_HONOURED = (
    "hidden_act",
    "attention_bias",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
    "layer_types",
)

KINDS = (
    _Kind(
        "llama",
        "LlamaForCausalLM",
        "Llama 2/3 (and SmolLM), transformers LlamaForCausalLM",
        _LLAMA_DEFAULTS,
        ("hidden_act", "attention_bias", "mlp_bias", "rope_interleaved"),
        ("pretraining_tp", "is_llama_config"),
        _llama_options,
        _llama_export,
    ),
    _Kind(
        "qwen2",
        "Qwen2ForCausalLM",
        "Qwen 2 and 2.5, transformers Qwen2ForCausalLM",
        _QWEN_DEFAULTS,
        ("hidden_act", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"),
        ("use_mrope",),
        _qwen2_options,
        _qwen2_export,
    ),
    _Kind(
        "qwen3",
        "Qwen3ForCausalLM",
        "Qwen 3, transformers Qwen3ForCausalLM",
        {**_QWEN_DEFAULTS, "head_dim": 128},
        _QWEN3_HONOURED,
        (),
        _qwen3_options,
        _qwen3_export,
    ),
    _Kind(
        "mistral",
        "MistralForCausalLM",
        "Mistral, transformers MistralForCausalLM",
        {
            **_LLAMA_DEFAULTS,
            "intermediate_size": 14336,
            "num_key_value_heads": 8,
            "max_position_embeddings": 4096 * 32,
            "sliding_window": 4096,
        },
        ("hidden_act", "sliding_window", "layer_types"),
        (),
        _mistral_options,
        _mistral_export,
    ),
    _Kind(
        "gemma3_text",
        "Gemma3ForCausalLM",
        "Gemma 3 text, transformers Gemma3ForCausalLM",
        {
            **_LLAMA_DEFAULTS,
            "vocab_size": 262_208,
            "hidden_size": 2304,
            "intermediate_size": 9216,
            "num_hidden_layers": 26,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": 131_072,
            "tie_word_embeddings": True,
            "query_pre_attn_scalar": 256,
            "sliding_window": 4096,
            "use_bidirectional_attention": False,
        },
        (
            "hidden_activation",
            "attention_bias",
            "query_pre_attn_scalar",
            "sliding_window",
            "layer_types",
            "sliding_window_pattern",
            "rope_local_base_freq",
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "use_bidirectional_attention",
        ),
        ("_sliding_window_pattern",),
        _gemma3_options,
        _gemma3_export,
    ),
)

_MOE_DEFAULTS = {
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}
KINDS += (
    _Kind(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        "Qwen 3 mixture of experts (Qwen3-30B-A3B), transformers Qwen3MoeForCausalLM",
        {
            **_QWEN_DEFAULTS,
            **_MOE_DEFAULTS,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 24,
            "num_key_value_heads": 4,
            "num_local_experts": 128,
            "num_experts_per_tok": 8,
            "moe_intermediate_size": 768,
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
        (
            "hidden_act",
            "attention_bias",
            "use_sliding_window",
            "sliding_window",
            "num_experts",
            "num_local_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "norm_topk_prob",
            "decoder_sparse_step",
            "mlp_only_layers",
            "output_router_logits",
            "router_aux_loss_coef",
        ),
        ("max_window_layers", "layer_types"),  # not in its config: transformers reads neither
        _qwen3_moe_options,
        _qwen3_moe_export,
    ),
    _Kind(
        "mixtral",
        "MixtralForCausalLM",
        "Mixtral, transformers MixtralForCausalLM",
        {
            **_LLAMA_DEFAULTS,
            **_MOE_DEFAULTS,
            "intermediate_size": 14336,
            "num_key_value_heads": 8,
            "max_position_embeddings": 4096 * 32,
            "rms_norm_eps": 1e-5,
            "sliding_window": None,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "router_jitter_noise": 0.0,
            "rope_theta": 1_000_000.0,
        },
        (
            "hidden_act",
            "sliding_window",
            "layer_types",
            "num_experts",
            "num_local_experts",
            "num_experts_per_tok",
            "output_router_logits",
            "router_aux_loss_coef",
            "router_jitter_noise",
        ),
        (),
        _mixtral_options,
        _mixtral_export,
    ),
)

_GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
"""transformers' RoPE for a gpt_oss config that gives none (`GptOssConfig.__post_init__`)."""
KINDS += (
    _Kind(
        "gpt_oss",
        "GptOssForCausalLM",
        "gpt-oss (gpt-oss-20b, gpt-oss-120b), transformers GptOssForCausalLM",
        {
            **_LLAMA_DEFAULTS,
            **_MOE_DEFAULTS,
            "vocab_size": 201088,
            "hidden_size": 2880,
            "intermediate_size": 2880,
            "num_hidden_layers": 36,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "attention_bias": True,
            "sliding_window": 128,
            "num_local_experts": 128,
            "num_experts_per_tok": 4,
            "swiglu_limit": 7.0,
            "swiglu_alpha": 1.702,
            "rope_theta": 150000.0,
        },
        (
            "attention_bias",
            "sliding_window",
            "layer_types",
            "num_experts",
            "num_local_experts",
            "num_experts_per_tok",
            "swiglu_limit",
            "swiglu_alpha",
            "output_router_logits",
            "router_aux_loss_coef",
        ),
        # transformers' gpt-oss reads neither hidden_act (its experts' clamped SwiGLU is its
        # own) nor the original release's experts_per_token and initial_context_length, which
        # repeat num_experts_per_tok and the YaRN original_max_position_embeddings.
        ("hidden_act", "experts_per_token", "initial_context_length"),
        _gpt_oss_options,
        _gpt_oss_export,
        quantized=(MXFP4_EXPERTS,),
    ),
)

KINDS += (
    _Kind(
        "deepseek_v3",
        "DeepseekV3ForCausalLM",
        "DeepSeek V3 (and R1), transformers DeepseekV3ForCausalLM",
        {
            **_LLAMA_DEFAULTS,
            "vocab_size": 129280,
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "num_hidden_layers": 61,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "n_shared_experts": 1,
            "n_routed_experts": 256,
            "routed_scaling_factor": 2.5,
            "kv_lora_rank": 512,
            "q_lora_rank": 1536,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "qk_nope_head_dim": 128,
            "n_group": 8,
            "topk_group": 4,
            "num_experts_per_tok": 8,
            "first_k_dense_replace": 3,
            "norm_topk_prob": True,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_interleave": True,
        },
        (
            "hidden_act",
            "attention_bias",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "qk_nope_head_dim",
            "v_head_dim",
            "rope_interleave",
            "n_routed_experts",
            "num_local_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "n_shared_experts",
            "routed_scaling_factor",
            "n_group",
            "topk_group",
            "norm_topk_prob",
            "first_k_dense_replace",
            *_DEEPSEEK_HUB_VALUES,
        ),
        # transformers derives qk_head_dim (nope + rope) and head_dim (the rotary width) itself
        # whatever the config says; it computes no load-balancing loss (output_router_logits
        # only returns the router's logits), and loads no multi-token-prediction layers
        # (num_nextn_predict_layers; their weights, model.layers.<num_hidden_layers>.*, are
        # ignored); the hub code's ep_size (expert parallelism), aux_loss_alpha and seq_aux (a
        # training loss) change nothing it computes.
        (
            "qk_head_dim",
            "pretraining_tp",
            "output_router_logits",
            "num_nextn_predict_layers",
            "num_mtp_layers",
            "ep_size",
            "aux_loss_alpha",
            "seq_aux",
        ),
        _deepseek_v3_options,
        _deepseek_v3_export,
    ),
)

HONOURED = {kind.name: (*_SIZES, *kind.honoured) for kind in KINDS}
"""Per family: the config.json keys that `hparams` reads (or refuses by value)."""
INERT = {kind.name: (*_INERT, *kind.inert) for kind in KINDS}
"""Per family: the config.json keys that do not change what the model computes, besides
`COMMON_INERT`."""


def _matches(name: str) -> Callable[[Mapping[str, Any]], bool]:
    return lambda config: config.get("model_type") == name


def _family(kind: _Kind) -> Family:
    return Family(
        name=kind.name,
        model="decoder",
        matches=_matches(kind.name),
        hparams=_hparams(kind),
        rules=_rules(kind),
        ignore=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",),
        export_config=_export_config(kind),
        description=kind.description,
        stacked=_stacked_of(kind),
        honoured=HONOURED[kind.name],
        inert=INERT[kind.name],
        combine=kind.quantized,
        ignored=_multi_token_prediction if kind.name == "deepseek_v3" else lambda hparams: (),
    )


def _multi_token_prediction(hparams: Mapping[str, Any]) -> tuple[str, ...]:
    """DeepSeek V3's multi-token-prediction layers (`num_nextn_predict_layers`), stored as
    `model.layers.N.*` for N from `num_hidden_layers` on: transformers' DeepseekV3ForCausalLM
    builds and loads none (it ignores the hub's layer 61), and decoder ignores them too."""
    real = "|".join(str(i) for i in range(int(hparams["depth"])))
    return (rf"model\.layers\.(?!(?:{real})\.)\d+\..*",)


def _stacked_of(kind: _Kind) -> Callable[[Mapping[str, Any]], tuple[str, ...]]:
    """`_stacked`, for a family whose checkpoints keep each expert apart (gpt-oss's hold them
    stacked already, as `decoder` does: nothing to count)."""
    if kind.name != "gpt_oss":
        return _stacked
    return lambda hparams: tuple(p for p in _stacked(hparams) if ".mlp.experts" not in p)


def _stacked(hparams: Mapping[str, Any]) -> tuple[str, ...]:
    """The params whose leading axis the checkpoint's keys count: the layers stacked for
    scanning, or each mixture-of-experts layer's experts."""
    experts = hparams.get("num_experts")
    if hparams.get("scan_layers") and experts:
        raise ZooError(
            "model.scan_layers=true with a mixture of experts stacks the experts of stacked "
            "layers, which decoder does not load or export yet: set model.scan_layers=false."
        )
    if hparams.get("scan_layers"):
        return ("layers",)
    dense = set(hparams.get("dense_layers") or ())
    depth = hparams.get("depth", 0) if experts else 0
    return tuple(f"layers.{i}.mlp.experts" for i in range(depth) if i not in dense)


FAMILIES = tuple(register_family(_family(kind)) for kind in KINDS)

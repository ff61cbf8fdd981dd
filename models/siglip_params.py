"""transformers' `SiglipModel` checkpoints for `siglip` (family `siglip`): the key table, the
options read from `config.json`, and the config written on export.

Keys (`vision_model.*`, `text_model.*`, `logit_scale`, `logit_bias`): each tower's layers as
`hf-siglip-vision`'s (`self_attn.{q,k,v,out}_proj`, `layer_norm{1,2}`, `mlp.fc{1,2}`; Linear
weights (out, in), made (in, out) and split into heads); the image tower's attention-pooling head
holds torch's `MultiheadAttention`, its query, key and value rows packed in `in_proj_weight`
(q | k | v). The image processor's `preprocessor_config.json` is read where images are
prepared (`zoo.data.image_processors`), not by the model: it is inert here and written back on
export at the model's image size.

Refused by name: SigLIP 2 (`model_type: siglip2`), an activation other than GELU, towers whose
activations or LayerNorm epsilons differ (siglip holds one of each), a tower without its
attention-pooling head (`vision_use_head: false`), a text projection narrower or wider than the
image embedding (`projection_size`), non-square images or patches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from zoo.models.hf_config import PREPROCESSOR, preprocessor_config
from zoo.models.vit_params import (
    _SIGLIP_VISION_DEFAULTS,
    _TANH,
    _block_rules,
    _linear,
    _norm,
    _rule,
    _square,
    _transforms,
)

from zoo.plugin import COMMON_INERT, Rule, ZooError, register_families

ARCHITECTURE = "SiglipModel"
HALF = [0.5, 0.5, 0.5]
TEXT_DEFAULTS = {
    "vocab_size": 32000,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 64,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
"""`SiglipTextConfig`'s defaults (google/siglip-base-patch16-224's), which hub configs leave
out; `projection_size` defaults to `hidden_size`."""


def _matches(config: Mapping[str, Any]) -> bool:
    """A `SiglipModel` (SigLIP 2's too, to refuse it by name)."""
    kind = config.get("model_type")
    return kind in ("siglip", "siglip2") and ARCHITECTURE in (config.get("architectures") or [])


def _towers(config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(vision, text) configs with their defaults, refused where siglip differs."""
    if config.get("model_type") != "siglip":
        raise ZooError(
            f"This SigLIP checkpoint has model_type={config.get('model_type')!r}: siglip loads "
            "model_type 'siglip' (SiglipModel); SigLIP 2 is not supported."
        )
    vision = {**_SIGLIP_VISION_DEFAULTS, **(config.get("vision_config") or {})}
    text = {**TEXT_DEFAULTS, **(config.get("text_config") or {})}
    for name, tower in (("vision_config", vision), ("text_config", text)):
        if tower["hidden_act"] not in ("gelu", *_TANH):
            raise ZooError(
                f"This SigLIP config has {name}.hidden_act={tower['hidden_act']!r}: siglip "
                f"loads a GELU (gelu or one of {', '.join(_TANH)})."
            )
    if vision.get("vision_use_head", True) is False:
        raise ZooError(
            "This SigLIP config has vision_config.vision_use_head=false: siglip's image "
            "embedding is its attention-pooling head's output."
        )
    return vision, text


def _same(vision: Mapping[str, Any], text: Mapping[str, Any]) -> tuple[float, bool]:
    """The LayerNorm epsilon and exact-GELU flag both towers share, refused where they differ."""
    epsilon = float(vision["layer_norm_eps"])
    exact = vision["hidden_act"] == "gelu"
    if float(text["layer_norm_eps"]) != epsilon or (text["hidden_act"] == "gelu") != exact:
        raise ZooError(
            f"This SigLIP config's towers differ: vision_config.layer_norm_eps={epsilon}, "
            f"hidden_act={vision['hidden_act']!r}; text_config.layer_norm_eps="
            f"{text['layer_norm_eps']}, hidden_act={text['hidden_act']!r}: siglip holds one "
            "epsilon and one GELU for both."
        )
    return epsilon, exact


def _hparams(config: Mapping[str, Any]) -> dict[str, Any]:
    vision, text = _towers(config)
    epsilon, exact = _same(vision, text)
    side, patch = _square(vision, "image_size"), _square(vision, "patch_size")
    dim = int(vision["hidden_size"])
    projection = int(text.get("projection_size") or text["hidden_size"])
    if projection != dim:
        raise ZooError(
            f"This SigLIP config has text_config.projection_size={projection} and "
            f"vision_config.hidden_size={dim}: siglip scores texts against images of one width."
        )
    return {
        "input_shape": [side, side, int(vision["num_channels"])],
        "patch_size": patch,
        "vision_dim": dim,
        "vision_depth": int(vision["num_hidden_layers"]),
        "vision_heads": int(vision["num_attention_heads"]),
        "vision_mlp_dim": int(vision["intermediate_size"]),
        "vocab_size": int(text["vocab_size"]),
        "context_length": int(text["max_position_embeddings"]),
        "text_dim": int(text["hidden_size"]),
        "text_depth": int(text["num_hidden_layers"]),
        "text_heads": int(text["num_attention_heads"]),
        "text_mlp_dim": int(text["intermediate_size"]),
        "projection_dim": projection,
        "norm_epsilon": epsilon,
        "exact_gelu": exact,
    }


def _layout(hparams: Mapping[str, Any], tower: str) -> dict[str, Any]:
    """`vit_params._transforms`'s view of one tower's sizes."""
    side, channels = hparams["input_shape"][0], hparams["input_shape"][-1]
    grid = side // hparams["patch_size"]
    return {
        "dim": hparams[f"{tower}_dim"],
        "num_heads": hparams[f"{tower}_heads"],
        "position_grid": [grid, grid],
        "class_token": False,
        "input_shape": [side, side, channels],
    }


def _under(prefix: str, rules: list[Rule]) -> list[Rule]:
    """`rules` whose params live under `prefix` (`vision`, `text`)."""
    return [
        dataclasses.replace(rule, params=tuple(f"{prefix}.{p}" for p in rule.params))
        for rule in rules
    ]


def _tower_rules(t: Mapping[str, Any], key: str, module: str, final: str) -> list[Rule]:
    """One tower's blocks (`{key}.encoder.layers.N`) and final LayerNorm (`{key}.{final}`)."""
    block = f"{key}.encoder.layers.N"
    blocks = _block_rules(
        t,
        norms=(f"{block}.layer_norm1", f"{block}.layer_norm2"),
        query=lambda name: f"{block}.self_attn.{name[0]}_proj",
        out=f"{block}.self_attn.out_proj",
        mlp=(f"{block}.mlp.fc1", f"{block}.mlp.fc2"),
    )
    return _under(module, [*blocks, *_norm(f"{key}.{final}", "norm")])


def _head_rules(t: Mapping[str, Any]) -> list[Rule]:
    """The attention-pooling head: its probe, packed q | k | v, output, LayerNorm and MLP."""
    key = "vision_model.head"
    qkv = ("head.query", "head.key", "head.value")
    return [
        _rule(f"{key}.probe", "head.probe", *t["token"]),
        _rule(f"{key}.attention.in_proj_weight", " ".join(f"{p}.kernel" for p in qkv), *t["qkv"]),
        _rule(f"{key}.attention.in_proj_bias", " ".join(f"{p}.bias" for p in qkv), *t["qkv_bias"]),
        *_linear(f"{key}.attention.out_proj", "head.out", t["out"]),
        *_norm(f"{key}.layernorm", "head.norm"),
        *_linear(f"{key}.mlp.fc1", "head.mlp_in", t["linear"]),
        *_linear(f"{key}.mlp.fc2", "head.mlp_out", t["linear"]),
    ]


def _rules(hparams: Mapping[str, Any]) -> list[Rule]:
    vision, text = _transforms(_layout(hparams, "vision")), _transforms(_layout(hparams, "text"))
    embeddings = "vision_model.embeddings"
    return [
        _rule(f"{embeddings}.position_embedding.weight", "positions"),
        *_linear(f"{embeddings}.patch_embedding", "embed", vision["patches"]),
        *_tower_rules(vision, "vision_model", "vision", "post_layernorm"),
        *_head_rules(vision),
        _rule("text_model.embeddings.token_embedding.weight", "token_embedding"),
        _rule("text_model.embeddings.position_embedding.weight", "text_positions"),
        *_tower_rules(text, "text_model", "text", "final_layer_norm"),
        *_linear("text_model.head", "projection", text["linear"]),
        _rule("logit_scale", "logit_scale"),
        _rule("logit_bias", "logit_bias"),
    ]


def _tower_config(hparams: Mapping[str, Any], tower: str) -> dict[str, Any]:
    return {
        "hidden_size": hparams[f"{tower}_dim"],
        "intermediate_size": hparams[f"{tower}_mlp_dim"],
        "num_hidden_layers": hparams[f"{tower}_depth"],
        "num_attention_heads": hparams[f"{tower}_heads"],
        "hidden_act": "gelu" if hparams["exact_gelu"] else "gelu_pytorch_tanh",
        "layer_norm_eps": hparams["norm_epsilon"],
        "attention_dropout": 0.0,
    }


def _config(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """`SiglipModel`'s config, and `SiglipImageProcessor`'s settings at the model's size."""
    side, channels = hparams["input_shape"][0], hparams["input_shape"][-1]
    if hparams["input_shape"][1] != side:
        raise ZooError(
            f"The SigLIP layout holds square images; these are {hparams['input_shape']}."
        )
    vision = {**_tower_config(hparams, "vision"), "model_type": "siglip_vision_model"}
    vision |= {"image_size": side, "patch_size": hparams["patch_size"], "num_channels": channels}
    text = {**_tower_config(hparams, "text"), "model_type": "siglip_text_model"}
    text |= {
        "vocab_size": hparams["vocab_size"],
        "max_position_embeddings": hparams["context_length"],
        "projection_size": hparams["projection_dim"],
    }
    processor = preprocessor_config(
        "SiglipImageProcessor", {"height": side, "width": side}, HALF, HALF, [side, side, 3]
    )
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "siglip",
        "vision_config": {**vision, "vision_use_head": True},
        "text_config": text,
        PREPROCESSOR.removesuffix(".json"): {**processor, "resample": 3},
    }


_KEYS = {
    "honoured": (
        *(f"vision_config.{key}" for key in _SIGLIP_VISION_DEFAULTS),
        "vision_config.vision_use_head",
        *(f"text_config.{key}" for key in TEXT_DEFAULTS),
        "text_config.projection_size",
    ),
    "inert": (
        "initializer_factor",
        "vision_config.attention_dropout",
        "text_config.attention_dropout",
        *(f"{tower}.{key}" for tower in ("vision_config", "text_config") for key in COMMON_INERT),
        PREPROCESSOR.removesuffix(".json"),
    ),
    "sidecars": (PREPROCESSOR,),
}
"""The image processor's settings are read where images are prepared (and each checked there);
the towers' configs may repeat the keys every config carries (token ids, dtypes)."""

(SIGLIP,) = register_families(
    "siglip",
    (
        "siglip",
        _matches,
        _hparams,
        _rules,
        _config,
        "SigLIP, transformers SiglipModel (image and text embeddings, zero-shot)",
        _KEYS,
    ),
)

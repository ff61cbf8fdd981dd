"""ViT checkpoints for `vit`: Hugging Face transformers' `ViTForImageClassification` and timm's
`vit_*` (`VisionTransformer`); and SigLIP's vision tower with its classifier, transformers'
`SiglipForImageClassification` (family `hf-siglip-vision`).

Both are `vit` with a class token, attention biases and exact GELU; Hugging Face pools the class
token after a LayerNorm of eps 1e-12 and keeps query, key and value apart
(`vit.encoder.layer.N.attention.attention.query`); timm (eps 1e-6) fuses them (`attn.qkv`, rows
q | k | v, each head after head) and pools the class token (`global_pool=token`) or the mean of
the patches, then its `fc_norm` (`global_pool=avg`). Linear weights are stored (out, in) and
become (in, out), reshaped to heads for attention; the patch embedding is a convolution kernel.

timm's hub `config.json` names the `architecture` (`vit_base_patch16_224.augreg_in21k`, whose
sizes the name implies for tiny/small/base/large) and may carry `model_args` (timm's
`VisionTransformer` arguments: `embed_dim`, `depth`, `num_heads`, `mlp_ratio`, `patch_size`,
`img_size`, `class_token`, `global_pool`, `fc_norm`), `num_classes`, `global_pool` and
`pretrained_cfg` (`input_size`, `mean`, `std`). The model keeps the checkpoint's position grid
and resizes it for images of another size as the family's own code does (module docstring of
`zoo.models.vit`). Inputs are normalised by the model: timm's `pretrained_cfg` statistics, else
0.5 and 0.5 per channel (`ViTImageProcessor`'s and timm's ViTs' default); a Hugging Face
checkpoint's `preprocessor_config.json` (`image_mean`, `image_std`, `do_normalize`, `do_rescale`,
`rescale_factor`) where it has one, which its export writes back.

Every key of both layouts' configs is accounted for (`Family.honoured`, `inert`): the sizes,
activation, epsilon, biases, pooling, classes and normalisation are honoured; dropout rates,
`encoder_stride` (masked image modelling), the pooler of `ViTModel` (not part of the
classifier), timm's `num_features` and its `pretrained_cfg`'s provenance and crop settings, and
the image processor's resizing, cropping and format settings (`hf_config.PREPROCESSOR_INERT`)
are inert.

SigLIP's tower is `vit` without a class token, with biased attention (`self_attn.q_proj`, ...),
LayerNorm eps 1e-6 and tanh GELU; its classifier reads the mean of the tokens after the final
LayerNorm (`post_layernorm`). Its sizes are in the config's `vision_config`; an MLP width that is
no whole multiple of the features (so400m's 4304 of 1152) is vit's `mlp_dim`. The checkpoint may
hold the attention-pooling head of `SiglipModel`'s tower (`vision_use_head`), which the
classifier does not use: it is not loaded, and the export leaves it out. The text tower's config
is inert; SigLIP 2 and a bare `SiglipVisionModel` are refused by name (`SiglipModel` is
model `siglip`'s, `zoo.models.siglip_params`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from zoo.models.hf_config import (
    PREPROCESSOR,
    PREPROCESSOR_HONOURED,
    PREPROCESSOR_INERT,
    class_labels,
    pixel_statistics,
    preprocessor_config,
    transformer_config,
)
from zoo.models.torch_layout import conv_save, input_conv_load, linear_load, linear_save

from zoo.plugin import COMMON_INERT, Rule, ZooError, register_families

HALF = [0.5, 0.5, 0.5]
_TIMM_ARCHITECTURE = re.compile(r"vit_(tiny|small|base|large)_patch(\d+)_(\d+)(?:\..+)?")
_TIMM_SIZES = {"tiny": (192, 12, 3), "small": (384, 12, 6), "base": (768, 12, 12)}
_TIMM_SIZES["large"] = (1024, 24, 16)
_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
_HF_SIZE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "hidden_act",
    "layer_norm_eps",
)
_HF_LISTING = "ViT, transformers ViTForImageClassification"
_TIMM_LISTING = "ViT, timm vit_* (VisionTransformer)"
_HF_DROPOUTS = ("hidden_dropout_prob", "attention_probs_dropout_prob")


def _rule(key: str, params: str, load=None, save=None, export_key: str | None = None) -> Rule:
    """`key` with `.` literal and `N` standing for a block index (`\\1` in `params`)."""
    pattern = re.escape(key).replace("N", r"(\d+)")
    exported = export_key or key.replace("N", r"\1")
    transforms = {"load": load, "save": save}
    return Rule(
        pattern,
        tuple(params.split()),
        export_key=exported,
        **{k: v for k, v in transforms.items() if v is not None},
    )


def _transforms(hparams: Mapping[str, Any]) -> dict[str, tuple]:
    """(load, save) of each kind of tensor, for this model's sizes."""
    dim, heads = hparams["dim"], hparams["num_heads"]
    to_heads = (heads, dim // heads)
    grid = hparams["position_grid"]
    prefix = int(hparams["class_token"])
    return {
        "linear": (linear_load, linear_save),
        "query": (lambda w: (w.T.reshape(dim, *to_heads),), lambda k: k.reshape(dim, dim).T),
        "query_bias": (lambda b: (b.reshape(to_heads),), lambda b: b.reshape(dim)),
        "out": (lambda w: (w.T.reshape(*to_heads, dim),), lambda k: k.reshape(dim, dim).T),
        "qkv": (
            lambda w: tuple(p.T.reshape(dim, *to_heads) for p in np.split(w, 3)),
            lambda *ks: np.concatenate([k.reshape(dim, dim).T for k in ks]),
        ),
        "qkv_bias": (
            lambda b: tuple(p.reshape(to_heads) for p in np.split(b, 3)),
            lambda *bs: np.concatenate([b.reshape(dim) for b in bs]),
        ),
        "patches": (input_conv_load(hparams["input_shape"][-1]), conv_save),
        "positions": (
            lambda p: (p.reshape(prefix + grid[0] * grid[1], dim),),
            lambda p: p[None],
        ),
        "token": (lambda t: (t.reshape(dim),), lambda t: t.reshape(1, 1, dim)),
    }


def _norm(key: str, module: str) -> list[Rule]:
    return [_rule(f"{key}.weight", f"{module}.scale"), _rule(f"{key}.bias", f"{module}.bias")]


def _linear(key: str, module: str, kind: tuple, bias: tuple | None = None) -> list[Rule]:
    load, save = kind
    rules = [_rule(f"{key}.weight", f"{module}.kernel", load, save)]
    bias_rule = _rule(f"{key}.bias", f"{module}.bias", *(bias or (None, None)))
    return [*rules, bias_rule]


def _hf_rules(hparams: Mapping[str, Any]) -> list[Rule]:
    t, block = _transforms(hparams), "vit.encoder.layer.N"
    attention = f"{block}.attention"
    return [
        _rule("vit.embeddings.cls_token", "class_token", *t["token"]),
        _rule("vit.embeddings.position_embeddings", "positions", *t["positions"]),
        *_linear("vit.embeddings.patch_embeddings.projection", "embed", t["patches"]),
        *_block_rules(
            t,
            norms=(f"{block}.layernorm_before", f"{block}.layernorm_after"),
            query=lambda name: f"{attention}.attention.{name}",
            out=f"{attention}.output.dense",
            mlp=(f"{block}.intermediate.dense", f"{block}.output.dense"),
        ),
        *_norm("vit.layernorm", "norm"),
        *_linear("classifier", "head", t["linear"]),
    ]


def _block_rules(
    t: Mapping[str, Any],
    norms: tuple[str, str],
    query: Callable[[str], str],
    out: str,
    mlp: tuple[str, str],
) -> list[Rule]:
    """A Hugging Face layout's rules for layer N's pre-norm block, by the layout's names of its
    two norms, of its `query`, `key` and `value` projections, its output projection and its
    MLP's two layers; `t` the layout's transforms (`_transforms`)."""
    return [
        *_norm(norms[0], r"blocks.\1.attention_norm"),
        *(
            rule
            for name in ("query", "key", "value")
            for rule in _linear(
                query(name), rf"blocks.\1.attention.{name}", t["query"], t["query_bias"]
            )
        ),
        *_linear(out, r"blocks.\1.attention.out", t["out"]),
        *_norm(norms[1], r"blocks.\1.mlp_norm"),
        *_linear(mlp[0], r"blocks.\1.mlp_in", t["linear"]),
        *_linear(mlp[1], r"blocks.\1.mlp_out", t["linear"]),
    ]


def _timm_rules(hparams: Mapping[str, Any]) -> list[Rule]:
    t, attention = _transforms(hparams), r"blocks.\1.attention"
    qkv = f"{attention}.query {attention}.key {attention}.value"
    rules = [
        _rule("pos_embed", "positions", *t["positions"]),
        *_linear("patch_embed.proj", "embed", t["patches"]),
        *_norm("blocks.N.norm1", r"blocks.\1.attention_norm"),
        _rule("blocks.N.attn.qkv.weight", qkv.replace(" ", ".kernel ") + ".kernel", *t["qkv"]),
        _rule("blocks.N.attn.qkv.bias", qkv.replace(" ", ".bias ") + ".bias", *t["qkv_bias"]),
        *_linear("blocks.N.attn.proj", f"{attention}.out", t["out"]),
        *_norm("blocks.N.norm2", r"blocks.\1.mlp_norm"),
        *_linear("blocks.N.mlp.fc1", r"blocks.\1.mlp_in", t["linear"]),
        *_linear("blocks.N.mlp.fc2", r"blocks.\1.mlp_out", t["linear"]),
        *_norm("fc_norm" if hparams["norm_after_pool"] else "norm", "norm"),
        *_linear("head", "head", t["linear"]),
    ]
    if hparams["class_token"]:
        rules.append(_rule("cls_token", "class_token", *t["token"]))
    return rules


def _vit(**hparams: Any) -> dict[str, Any]:
    """Hyper-parameters shared by every pretrained ViT, `hparams` on top."""
    dim, heads, ratio = (
        hparams["dim"],
        hparams["num_heads"],
        hparams.pop("mlp_hidden") / hparams["dim"],
    )
    if ratio != int(ratio) or dim % heads:
        raise ZooError(
            f"This ViT checkpoint has an MLP {ratio} times as wide as its {dim} features and "
            f"{heads} heads: vit loads a whole MLP ratio and features divisible by the heads."
        )
    side, patch = hparams["input_shape"][0], hparams["patch_size"]
    return {
        "mlp_ratio": int(ratio),
        "dropout_rate": 0.0,
        "attention_bias": True,
        "exact_gelu": True,
        "norm_after_pool": False,
        "position_grid": [side // patch, side // patch],
        **hparams,
    }


def _is_hf(config: Mapping[str, Any]) -> bool:
    return config.get("model_type") == "vit"


def _hf_hparams(config: Mapping[str, Any]) -> dict[str, Any]:
    activation = config.get("hidden_act", "gelu")
    if not config.get("qkv_bias", True) or activation not in ("gelu", *_TANH):
        raise ZooError(
            f"This Hugging Face ViT config has qkv_bias={config.get('qkv_bias')} and "
            f"hidden_act={activation!r}: vit loads biased attention and a GELU "
            f"(gelu or one of {', '.join(_TANH)})."
        )
    side, channels = int(config.get("image_size", 224)), int(config.get("num_channels", 3))
    mean, std = pixel_statistics(config, HALF[:channels], HALF[:channels])
    return _vit(
        input_shape=[side, side, channels],
        num_classes=len(config.get("id2label") or {"0": 0, "1": 1}),
        patch_size=int(config.get("patch_size", 16)),
        dim=int(config["hidden_size"]),
        depth=int(config["num_hidden_layers"]),
        num_heads=int(config["num_attention_heads"]),
        mlp_hidden=int(config["intermediate_size"]),
        exact_gelu=activation == "gelu",
        norm_epsilon=float(config.get("layer_norm_eps", 1e-12)),
        class_token=True,
        pool="cls",
        position_resize="bicubic",
        pixel_mean=mean,
        pixel_std=std,
    )


def _hf_config(hparams: Mapping[str, Any]) -> dict[str, Any]:
    _check_square(hparams, "Hugging Face ViT")
    if not (hparams["class_token"] and hparams["pool"] == "cls" and hparams["attention_bias"]):
        raise ZooError(
            "Only a vit with model.class_token=true model.pool=cls model.attention_bias=true "
            "has the Hugging Face ViT layout."
        )
    side, channels = hparams["position_grid"][0] * hparams["patch_size"], hparams["input_shape"][-1]
    return {
        "architectures": ["ViTForImageClassification"],
        "model_type": "vit",
        "image_size": side,
        "patch_size": hparams["patch_size"],
        "num_channels": channels,
        **transformer_config(hparams, _HF_SIZE_KEYS, "gelu_pytorch_tanh", _HF_DROPOUTS),
        "qkv_bias": True,
        **class_labels(hparams["num_classes"]),
        "preprocessor_config": _square_processor("ViTImageProcessor", hparams, side, channels),
    }


def _square_processor(processor: str, hparams: Mapping[str, Any], side: int, channels: int):
    """The `preprocessor_config.json` of `processor` for square images of `side` pixels, with
    the model's pixel statistics (a half each where it has none)."""
    return preprocessor_config(
        processor,
        {"height": side, "width": side},
        hparams.get("pixel_mean") or HALF[:channels],
        hparams.get("pixel_std") or HALF[:channels],
        hparams["input_shape"],
    )


def _check_square(hparams: Mapping[str, Any], layout: str) -> None:
    grid = hparams["position_grid"]
    if grid[0] != grid[1]:
        raise ZooError(f"The {layout} layout holds square position grids; this one is {grid}.")


def _is_timm(config: Mapping[str, Any]) -> bool:
    return _TIMM_ARCHITECTURE.fullmatch(str(config.get("architecture", ""))) is not None


def _timm_hparams(config: Mapping[str, Any]) -> dict[str, Any]:
    size, patch, side = _TIMM_ARCHITECTURE.fullmatch(config["architecture"]).groups()
    dim, depth, heads = _TIMM_SIZES[size]
    args = {**config.get("model_args", {})}
    pretrained = config.get("pretrained_cfg", {})
    channels, height, _ = pretrained.get("input_size", [3, int(side), int(side)])
    side = int(args.get("img_size", height))
    pool = args.get("global_pool", config.get("global_pool", "token"))
    if pool not in ("token", "avg") or args.get("no_embed_class") or args.get("reg_tokens"):
        raise ZooError(
            f"This timm ViT pools with global_pool={pool!r} (or has register tokens, or "
            "positions without the class token): vit loads global_pool token or avg."
        )
    dim = int(args.get("embed_dim", dim))
    channels = int(args.get("in_chans", channels))
    fc_norm = args.get("fc_norm")
    return _vit(
        input_shape=[side, side, channels],
        num_classes=int(config.get("num_classes", 1000)),
        patch_size=int(args.get("patch_size", patch)),
        dim=dim,
        depth=int(args.get("depth", depth)),
        num_heads=int(args.get("num_heads", heads)),
        mlp_hidden=float(args.get("mlp_ratio", 4.0)) * dim,
        norm_epsilon=1e-6,
        class_token=bool(args.get("class_token", True)),
        pool="cls" if pool == "token" else "mean",
        norm_after_pool=pool == "avg" if fc_norm is None else bool(fc_norm),
        position_resize="bicubic_antialias",
        pixel_mean=list(pretrained.get("mean", HALF[:channels])),
        pixel_std=list(pretrained.get("std", HALF[:channels])),
    )


def _timm_config(hparams: Mapping[str, Any]) -> dict[str, Any]:
    _check_square(hparams, "timm ViT")
    side, channels = hparams["position_grid"][0] * hparams["patch_size"], hparams["input_shape"][-1]
    if not (hparams["attention_bias"] and hparams["exact_gelu"]) or hparams.get("mlp_dim"):
        raise ZooError(
            "Only a vit with attention biases, exact GELU and an MLP width of model.mlp_ratio "
            "(model.mlp_dim=0) has timm's ViT layout."
        )
    pool = "token" if hparams["pool"] == "cls" else "avg"
    return {
        "architecture": f"vit_base_patch{hparams['patch_size']}_{side}",
        "num_classes": hparams["num_classes"],
        "num_features": hparams["dim"],
        "global_pool": pool,
        "model_args": {
            "embed_dim": hparams["dim"],
            "depth": hparams["depth"],
            "num_heads": hparams["num_heads"],
            "mlp_ratio": hparams["mlp_ratio"],
            "patch_size": hparams["patch_size"],
            "img_size": side,
            "in_chans": channels,
            "class_token": hparams["class_token"],
            "global_pool": pool,
            "fc_norm": hparams["norm_after_pool"],
        },
        "pretrained_cfg": {
            "input_size": [channels, side, side],
            "mean": list(hparams.get("pixel_mean") or HALF[:channels]),
            "std": list(hparams.get("pixel_std") or HALF[:channels]),
        },
    }


_HF_KEYS = {
    "honoured": (
        *_HF_SIZE_KEYS,
        "image_size",
        "patch_size",
        "num_channels",
        "qkv_bias",
        "id2label",
        *PREPROCESSOR_HONOURED,
    ),
    "inert": (
        *_HF_DROPOUTS,
        "encoder_stride",
        "pooler_act",
        "pooler_output_size",
        *PREPROCESSOR_INERT,
    ),
    "sidecars": (PREPROCESSOR,),
}
_TIMM_ARGS = (
    "embed_dim",
    "depth",
    "num_heads",
    "mlp_ratio",
    "patch_size",
    "img_size",
    "in_chans",
    "class_token",
    "global_pool",
    "fc_norm",
    "no_embed_class",
    "reg_tokens",
)
TIMM_PRETRAINED_INERT = tuple(
    f"pretrained_cfg.{key}"
    for key in (
        "tag",
        "custom_load",
        "hf_hub_id",
        "hf_hub_filename",
        "source",
        "architecture",
        "url",
        "file",
        "state_dict",
        "license",
        "description",
        "origin_url",
        "paper_name",
        "paper_ids",
        "notes",
        "fixed_input_size",
        "interpolation",
        "crop_pct",
        "crop_mode",
        "test_input_size",
        "test_crop_pct",
        "min_input_size",
        "num_classes",
        "pool_size",
        "first_conv",
        "classifier",
        "label_offset",
    )
)
"""The keys of timm's `pretrained_cfg` that say where weights came from and how its own
evaluation resized and cropped images: none changes what the network computes."""
TIMM_PRETRAINED_HONOURED = (
    "pretrained_cfg.input_size",
    "pretrained_cfg.mean",
    "pretrained_cfg.std",
)
_TIMM_KEYS = {
    "honoured": (
        "architecture",
        "num_classes",
        "global_pool",
        *(f"model_args.{key}" for key in _TIMM_ARGS),
        *TIMM_PRETRAINED_HONOURED,
    ),
    "inert": ("num_features", "label_names", "label_descriptions", *TIMM_PRETRAINED_INERT),
}
_SIGLIP_TYPES = ("siglip", "siglip2", "siglip_vision_model")
_SIGLIP_CLASSIFIER = "SiglipForImageClassification"
_SIGLIP_LISTING = "ViT, transformers SiglipForImageClassification (SigLIP's vision tower)"
_SIGLIP_VISION_DEFAULTS = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
    "image_size": 224,
    "patch_size": 16,
    "num_channels": 3,
}
"""`SiglipVisionConfig`'s defaults (google/siglip-base-patch16-224's sizes), which hub configs
leave out."""


def _is_siglip(config: Mapping[str, Any]) -> bool:
    """SigLIP's configs but `SiglipModel`'s (model `siglip` loads those), including those that
    `_siglip_hparams` refuses (SigLIP 2, a bare vision tower): they are refused by name rather
    than as matching no family."""
    architectures = config.get("architectures") or []
    return config.get("model_type") in _SIGLIP_TYPES and "SiglipModel" not in architectures


def _is_siglip_model(config: Mapping[str, Any]) -> bool:
    """A `SiglipModel` (SigLIP 2's too, to refuse it by name): model `siglip`'s by default, its
    vision tower vit's classifier when `model=vit` is named."""
    architectures = config.get("architectures") or []
    return config.get("model_type") in _SIGLIP_TYPES and "SiglipModel" in architectures


def _siglip_model_hparams(config: Mapping[str, Any]) -> dict[str, Any]:
    """`_siglip_hparams` of a `SiglipModel`'s vision tower (its text tower, scores and
    attention-pooling head not loaded; the classifier is fresh: `replace_head=True`)."""
    if config.get("model_type") != "siglip":
        raise ZooError(
            f"This SigLIP checkpoint has model_type={config.get('model_type')!r}: vit loads the "
            "vision tower of model_type 'siglip' (SigLIP 2 is not supported)."
        )
    return _siglip_hparams({**config, "architectures": [_SIGLIP_CLASSIFIER]})


def _refuse_siglip(config: Mapping[str, Any]) -> None:
    """Only the classifier: SigLIP 2 (its own patch embedding and resizing) and a
    `SiglipVisionModel` without a classifier are refused by name (`SiglipModel`'s image-text
    pair is model `siglip`'s)."""
    kind, architectures = config.get("model_type"), config.get("architectures") or []
    if kind != "siglip" or any(a != _SIGLIP_CLASSIFIER for a in architectures):
        raise ZooError(
            f"This SigLIP checkpoint has model_type={kind!r} and architectures={architectures}: "
            f"vit loads model_type 'siglip' of architecture {_SIGLIP_CLASSIFIER} (the vision "
            "tower and its classifier); SigLIP 2 and a bare SiglipVisionModel are not supported "
            "(SiglipModel loads as model siglip)."
        )


def _square(vision: Mapping[str, Any], key: str) -> int:
    """`image_size` or `patch_size`: a number, or a list of two equal ones."""
    value = vision.get(key, _SIGLIP_VISION_DEFAULTS[key])
    sides = list(value) if isinstance(value, list | tuple) else [value, value]
    if len(sides) != 2 or sides[0] != sides[1]:
        raise ZooError(
            f"This SigLIP config has vision_config.{key}={value!r}: vit loads square images "
            "and patches (one number, or two equal ones)."
        )
    return int(sides[0])


def _mlp_width(hidden: int, dim: int) -> dict[str, int]:
    """`mlp_ratio` where the MLP is a whole multiple of the features wide, else `mlp_dim`."""
    if hidden % dim == 0:
        return {"mlp_ratio": hidden // dim, "mlp_dim": 0}
    return {"mlp_ratio": max(1, hidden // dim), "mlp_dim": hidden}


def _siglip_hparams(config: Mapping[str, Any]) -> dict[str, Any]:
    """`vit` as SigLIP's vision tower: no class token, biased attention, the mean of the tokens
    after the final LayerNorm (`post_layernorm`), then `classifier`."""
    _refuse_siglip(config)
    vision = {**_SIGLIP_VISION_DEFAULTS, **(config.get("vision_config") or {})}
    activation = vision["hidden_act"]
    if activation not in ("gelu", *_TANH):
        raise ZooError(
            f"This SigLIP config has vision_config.hidden_act={activation!r}: vit loads a GELU "
            f"(gelu or one of {', '.join(_TANH)})."
        )
    side, patch = _square(vision, "image_size"), _square(vision, "patch_size")
    channels, dim = int(vision["num_channels"]), int(vision["hidden_size"])
    mean, std = pixel_statistics(config, HALF[:channels], HALF[:channels])
    return {
        "input_shape": [side, side, channels],
        "num_classes": len(config.get("id2label") or {"0": 0, "1": 1}),
        "patch_size": patch,
        "dim": dim,
        "depth": int(vision["num_hidden_layers"]),
        "num_heads": int(vision["num_attention_heads"]),
        **_mlp_width(int(vision["intermediate_size"]), dim),
        "dropout_rate": 0.0,
        "class_token": False,
        "pool": "mean",
        "norm_after_pool": False,
        "attention_bias": True,
        "norm_epsilon": float(vision["layer_norm_eps"]),
        "exact_gelu": activation == "gelu",
        "position_grid": [side // patch, side // patch],
        "position_resize": "bicubic",
        "pixel_mean": mean,
        "pixel_std": std,
    }


def _siglip_rules(hparams: Mapping[str, Any]) -> list[Rule]:
    t, block = _transforms(hparams), "vision_model.encoder.layers.N"
    return [
        _rule("vision_model.embeddings.position_embedding.weight", "positions"),
        *_linear("vision_model.embeddings.patch_embedding", "embed", t["patches"]),
        *_block_rules(
            t,
            norms=(f"{block}.layer_norm1", f"{block}.layer_norm2"),
            query=lambda name: f"{block}.self_attn.{name[0]}_proj",
            out=f"{block}.self_attn.out_proj",
            mlp=(f"{block}.mlp.fc1", f"{block}.mlp.fc2"),
        ),
        *_norm("vision_model.post_layernorm", "norm"),
        *_linear("classifier", "head", t["linear"]),
    ]


def _siglip_config(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """`SiglipForImageClassification` without the attention-pooling head it does not use
    (`vision_use_head=false`), and `SiglipImageProcessor`'s settings."""
    _check_square(hparams, "SigLIP")
    if (
        hparams["class_token"]
        or hparams["pool"] != "mean"
        or hparams["norm_after_pool"]
        or not hparams["attention_bias"]
    ):
        raise ZooError(
            "Only a vit with model.class_token=false model.pool=mean model.norm_after_pool=false "
            "model.attention_bias=true has the SigLIP layout."
        )
    side, channels = hparams["position_grid"][0] * hparams["patch_size"], hparams["input_shape"][-1]
    vision = {
        "model_type": "siglip_vision_model",
        "image_size": side,
        "patch_size": hparams["patch_size"],
        "num_channels": channels,
        **transformer_config(hparams, _HF_SIZE_KEYS, "gelu_pytorch_tanh", ("attention_dropout",)),
        "vision_use_head": False,
    }
    return {
        "architectures": [_SIGLIP_CLASSIFIER],
        "model_type": "siglip",
        "vision_config": vision,
        **class_labels(hparams["num_classes"]),
        "preprocessor_config": _square_processor("SiglipImageProcessor", hparams, side, channels),
    }


_SIGLIP_KEYS = {
    "honoured": (
        "id2label",
        *(f"vision_config.{key}" for key in _SIGLIP_VISION_DEFAULTS),
        *PREPROCESSOR_HONOURED,
    ),
    "inert": (
        "initializer_factor",
        "text_config",
        "vision_config.attention_dropout",
        "vision_config.vision_use_head",
        *(f"vision_config.{key}" for key in COMMON_INERT),
        *PREPROCESSOR_INERT,
    ),
    "sidecars": (PREPROCESSOR,),
}
"""The text tower (`text_config`) and the attention-pooling head (`vision_use_head`) are not
part of the classifier, which reads the mean of the tokens; `vision_config` may repeat the keys
every config carries."""
_SIGLIP_IGNORE = (r"vision_model\.head\..*",)
"""The attention-pooling head's params, which `SiglipForImageClassification` holds unused."""


HF_VIT, TIMM_VIT = register_families(
    "vit",
    ("hf-vit", _is_hf, _hf_hparams, _hf_rules, _hf_config, _HF_LISTING, _HF_KEYS),
    ("timm-vit", _is_timm, _timm_hparams, _timm_rules, _timm_config, _TIMM_LISTING, _TIMM_KEYS),
)
(SIGLIP_VISION,) = register_families(
    "vit",
    (
        "hf-siglip-vision",
        _is_siglip,
        _siglip_hparams,
        _siglip_rules,
        _siglip_config,
        _SIGLIP_LISTING,
        _SIGLIP_KEYS,
    ),
    ignore=_SIGLIP_IGNORE,
)
_SIGLIP_MODEL_IGNORE = (*_SIGLIP_IGNORE, r"text_model\..*", r"logit_scale", r"logit_bias")
"""A `SiglipModel`'s params besides its vision tower's: the text tower and the scores' scale and
bias."""
(SIGLIP_MODEL_VISION,) = register_families(
    "vit",
    (
        "hf-siglip-model-vision",
        _is_siglip_model,
        _siglip_model_hparams,
        _siglip_rules,
        _siglip_config,
        "ViT, the vision tower of transformers SiglipModel (with model=vit; a fresh classifier)",
        {**_SIGLIP_KEYS, "by_default": False},
    ),
    ignore=_SIGLIP_MODEL_IGNORE,
)

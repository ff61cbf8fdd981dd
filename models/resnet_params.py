"""ResNet-18, -34 and -50 checkpoints for `resnet`: torchvision's and timm's layout (the same
keys: `conv1`, `bn1`, `layer1.0.conv1`, `layer1.0.downsample.0`, `fc`) and Hugging Face
transformers' `ResNetForImageClassification` (`resnet.embedder.embedder.convolution`,
`resnet.encoder.stages.N.layers.M.layer.K`, `shortcut`, `classifier.1`).

All are the ImageNet ResNet: a 7x7 stride-2 stem and 3x3 max-pool, torch's symmetric padding,
BatchNorm (eps 1e-5) whose running statistics are loaded with its scale and shift, bottleneck
blocks strided in their 3x3 convolution. Convolution kernels are stored (out, in, h, w) and
become (h, w, in, out); a 1-channel model (grayscale data) takes the stem's kernel summed over
its three input channels, as timm adapts one.

torchvision and timm ship no `config.json` of their own layout; the directory's `config.json` is
that of timm's hub repositories: `architecture` (`resnet18`, `resnet34`, `resnet50`, with an
optional `.tag`), `num_classes`, `num_features` (the head's input width, which gives the stem's
width) and `pretrained_cfg` (`input_size`, `mean`, `std`). For torchvision's weights saved as
safetensors, write `{"architecture": "resnet50", "num_classes": 1000}` beside them.

Inputs are normalised by the model itself (`pixel_mean`/`pixel_std`): timm's `pretrained_cfg`
statistics where given, a Hugging Face checkpoint's `preprocessor_config.json` (`image_mean`,
`image_std`, `do_normalize`, `do_rescale`, `rescale_factor`) where it has one, else ImageNet's,
which torchvision's and Hugging Face's ResNets use. The network pools globally, so it takes
images of any size; the `input_shape` a checkpoint implies is the size it was trained at.

Every key of both layouts' configs is accounted for (`Family.honoured`, `inert`): the depths,
widths, block kind, activation, classes, pooling and normalisation are honoured (a timm
`global_pool` other than `avg` refused); the backbone outputs of Hugging Face's `ResNetBackbone`
(`out_features`, `out_indices`, `stage_names`), timm's `pretrained_cfg` provenance and crop
settings and the image processor's resizing and format settings are inert.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from zoo.models.hf_config import (
    PREPROCESSOR,
    PREPROCESSOR_HONOURED,
    PREPROCESSOR_INERT,
    class_labels,
    pixel_statistics,
    preprocessor_config,
)
from zoo.models.resnet import BOTTLENECK_EXPANSION
from zoo.models.torch_layout import conv_load, conv_save, input_conv_load, linear_load, linear_save
from zoo.models.vit_params import TIMM_PRETRAINED_HONOURED, TIMM_PRETRAINED_INERT

from zoo.plugin import Rule, ZooError, register_families

IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
DEPTHS = {
    "resnet18": ("basic", [2, 2, 2, 2]),
    "resnet34": ("basic", [3, 4, 6, 3]),
    "resnet50": ("bottleneck", [3, 4, 6, 3]),
}
_TIMM_ARCHITECTURE = re.compile(r"(resnet(?:18|34|50))(?:\..+)?")
_IMAGE_SIZE = [224, 224, 3]
_IGNORE = (r".*num_batches_tracked",)
_TIMM_LISTING = "ResNet-18/34/50, timm and torchvision key layout"
_HF_LISTING = "ResNet, transformers ResNetForImageClassification"


def _conv(key: str, param: str, load=conv_load) -> Rule:
    return Rule(re.escape(key), (param,), load=load, save=conv_save, export_key=key)


def _norm(key: str, module: str) -> list[Rule]:
    names = {"weight": "scale", "bias": "bias", "running_mean": "mean", "running_var": "var"}
    return [
        Rule(re.escape(f"{key}.{k}"), (f"{module}.{v}",), export_key=f"{key}.{k}")
        for k, v in names.items()
    ]


def _head(key: str) -> list[Rule]:
    return [
        Rule(
            re.escape(f"{key}.weight"),
            ("head.kernel",),
            load=linear_load,
            save=linear_save,
            export_key=f"{key}.weight",
        ),
        Rule(re.escape(f"{key}.bias"), ("head.bias",), export_key=f"{key}.bias"),
    ]


def _blocks(hparams: Mapping[str, Any]):
    """(stage, index in the stage, zoo block index, has a projection) of every block."""
    width, expansion = hparams["width"], _expansion(hparams)
    flat, cin = 0, width
    for stage, size in enumerate(hparams["stage_sizes"]):
        cout = width * 2**stage * expansion
        for index in range(size):
            yield stage, index, flat, cin != cout or (stage > 0 and index == 0)
            flat, cin = flat + 1, cout


def _expansion(hparams: Mapping[str, Any]) -> int:
    return BOTTLENECK_EXPANSION if hparams["block"] == "bottleneck" else 1


def _convs_in_block(hparams: Mapping[str, Any]) -> int:
    return 3 if hparams["block"] == "bottleneck" else 2


def _check_exportable(hparams: Mapping[str, Any], family: str) -> None:
    if hparams.get("stem") != "imagenet" or hparams.get("padding") != "symmetric":
        raise ZooError(
            f"Only an ImageNet-layout resnet (model.stem=imagenet model.padding=symmetric, as "
            f"loaded from a checkpoint) has the {family} layout; this one has "
            f"stem={hparams.get('stem')!r} padding={hparams.get('padding')!r}."
        )


def _torchvision_rules(hparams: Mapping[str, Any]) -> list[Rule]:
    _check_exportable(hparams, "torchvision/timm")
    rules = [
        _conv("conv1.weight", "stem.kernel", input_conv_load(hparams["input_shape"][-1])),
        *_norm("bn1", "stem_norm"),
        *_head("fc"),
    ]
    for stage, index, flat, projected in _blocks(hparams):
        prefix, block = f"layer{stage + 1}.{index}", f"blocks.{flat}"
        for k in range(1, _convs_in_block(hparams) + 1):
            rules += [_conv(f"{prefix}.conv{k}.weight", f"{block}.conv{k}.kernel")]
            rules += _norm(f"{prefix}.bn{k}", f"{block}.norm{k}")
        if projected:
            rules += [_conv(f"{prefix}.downsample.0.weight", f"{block}.project.kernel")]
            rules += _norm(f"{prefix}.downsample.1", f"{block}.project_norm")
    return rules


def _hf_rules(hparams: Mapping[str, Any]) -> list[Rule]:
    _check_exportable(hparams, "Hugging Face ResNet")
    stem = "resnet.embedder.embedder"
    rules = [
        _conv(
            f"{stem}.convolution.weight", "stem.kernel", input_conv_load(hparams["input_shape"][-1])
        ),
        *_norm(f"{stem}.normalization", "stem_norm"),
        *_head("classifier.1"),
    ]
    for stage, index, flat, projected in _blocks(hparams):
        prefix, block = f"resnet.encoder.stages.{stage}.layers.{index}", f"blocks.{flat}"
        for k in range(_convs_in_block(hparams)):
            rules += [
                _conv(f"{prefix}.layer.{k}.convolution.weight", f"{block}.conv{k + 1}.kernel")
            ]
            rules += _norm(f"{prefix}.layer.{k}.normalization", f"{block}.norm{k + 1}")
        if projected:
            rules += [_conv(f"{prefix}.shortcut.convolution.weight", f"{block}.project.kernel")]
            rules += _norm(f"{prefix}.shortcut.normalization", f"{block}.project_norm")
    return rules


def _imagenet_resnet(
    block: str, stage_sizes: list[int], width: int, num_classes: int, input_shape: list[int]
) -> dict[str, Any]:
    return {
        "input_shape": input_shape,
        "num_classes": num_classes,
        "width": width,
        "stage_sizes": stage_sizes,
        "block": block,
        "stem": "imagenet",
        "padding": "symmetric",
    }


def _is_timm(config: Mapping[str, Any]) -> bool:
    return _TIMM_ARCHITECTURE.fullmatch(str(config.get("architecture", ""))) is not None


def _timm_hparams(config: Mapping[str, Any]) -> dict[str, Any]:
    architecture = _TIMM_ARCHITECTURE.fullmatch(config["architecture"])[1]
    if config.get("global_pool", "avg") != "avg":
        raise ZooError(
            f"This timm ResNet pools with global_pool={config['global_pool']!r}: resnet loads "
            "global_pool avg, the average of the last stage's features."
        )
    block, stage_sizes = DEPTHS[architecture]
    features = int(
        config.get("num_features", 512 * (BOTTLENECK_EXPANSION if block == "bottleneck" else 1))
    )
    width = features // (8 * (BOTTLENECK_EXPANSION if block == "bottleneck" else 1))
    pretrained = config.get("pretrained_cfg", {})
    channels, height, side = pretrained.get("input_size", [3, 224, 224])
    hparams = _imagenet_resnet(
        block, stage_sizes, width, int(config.get("num_classes", 1000)), [height, side, channels]
    )
    hparams["pixel_mean"] = list(pretrained.get("mean", IMAGENET_MEAN))
    hparams["pixel_std"] = list(pretrained.get("std", IMAGENET_STD))
    return hparams


def _architecture(hparams: Mapping[str, Any]) -> str:
    for name, (block, stage_sizes) in DEPTHS.items():
        if block == hparams["block"] and list(stage_sizes) == list(hparams["stage_sizes"]):
            return name
    raise ZooError(
        f"A resnet of {hparams['block']} blocks in stages {hparams['stage_sizes']} is none of "
        f"{', '.join(DEPTHS)}, the depths that torchvision's and timm's ResNets name."
    )


def _timm_config(hparams: Mapping[str, Any]) -> dict[str, Any]:
    height, side, channels = hparams["input_shape"]
    return {
        "architecture": _architecture(hparams),
        "num_classes": hparams["num_classes"],
        "num_features": hparams["width"] * 8 * _expansion(hparams),
        "pretrained_cfg": {
            "input_size": [channels, height, side],
            "mean": list(hparams.get("pixel_mean") or IMAGENET_MEAN),
            "std": list(hparams.get("pixel_std") or IMAGENET_STD),
        },
    }


def _is_hf(config: Mapping[str, Any]) -> bool:
    return config.get("model_type") == "resnet"


def _hf_hparams(config: Mapping[str, Any]) -> dict[str, Any]:
    block = config.get("layer_type", "bottleneck")
    expansion = BOTTLENECK_EXPANSION if block == "bottleneck" else 1
    sizes = [int(size) for size in config.get("hidden_sizes", [256, 512, 1024, 2048])]
    width = int(config.get("embedding_size", 64))
    expected = [width * 2**stage * expansion for stage in range(len(sizes))]
    unusual = {
        key: config.get(key)
        for key in ("downsample_in_first_stage", "downsample_in_bottleneck")
        if config.get(key)
    }
    if sizes != expected or config.get("hidden_act", "relu") != "relu" or unusual:
        raise ZooError(
            f"This Hugging Face ResNet config (embedding_size={width}, hidden_sizes={sizes}, "
            f"layer_type={block!r}, hidden_act={config.get('hidden_act')!r}, {unusual}) is not "
            f"the ImageNet ResNet that resnet loads: it needs hidden_sizes={expected}, relu, "
            "and no downsample_in_first_stage or downsample_in_bottleneck."
        )
    channels = int(config.get("num_channels", 3))
    labels = config.get("id2label") or {str(i): f"LABEL_{i}" for i in range(2)}
    hparams = _imagenet_resnet(
        block,
        [int(d) for d in config.get("depths", [3, 4, 6, 3])],
        width,
        len(labels),
        [*_IMAGE_SIZE[:2], channels],
    )
    mean, std = (statistic[:channels] for statistic in (IMAGENET_MEAN, IMAGENET_STD))
    hparams["pixel_mean"], hparams["pixel_std"] = pixel_statistics(config, mean, std)
    return hparams


def _hf_config(hparams: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "architectures": ["ResNetForImageClassification"],
        "model_type": "resnet",
        "num_channels": hparams["input_shape"][-1],
        "embedding_size": hparams["width"],
        "hidden_sizes": [
            hparams["width"] * 2**stage * _expansion(hparams)
            for stage in range(len(hparams["stage_sizes"]))
        ],
        "depths": list(hparams["stage_sizes"]),
        "layer_type": hparams["block"],
        "hidden_act": "relu",
        "downsample_in_first_stage": False,
        "downsample_in_bottleneck": False,
        **class_labels(hparams["num_classes"]),
        "preprocessor_config": preprocessor_config(
            "ConvNextImageProcessor",
            {"shortest_edge": min(hparams["input_shape"][:2])},
            hparams.get("pixel_mean") or IMAGENET_MEAN,
            hparams.get("pixel_std") or IMAGENET_STD,
            hparams["input_shape"],
        ),
    }


_TIMM_KEYS = {
    "honoured": (
        "architecture",
        "num_classes",
        "num_features",
        "global_pool",
        *TIMM_PRETRAINED_HONOURED,
    ),
    "inert": ("label_names", "label_descriptions", *TIMM_PRETRAINED_INERT),
}
_HF_KEYS = {
    "honoured": (
        "depths",
        "downsample_in_bottleneck",
        "downsample_in_first_stage",
        "embedding_size",
        "hidden_act",
        "hidden_sizes",
        "layer_type",
        "num_channels",
        "id2label",
        *PREPROCESSOR_HONOURED,
    ),
    "inert": ("out_features", "out_indices", "stage_names", *PREPROCESSOR_INERT),
    "sidecars": (PREPROCESSOR,),
}
TIMM_RESNET, HF_RESNET = register_families(
    "resnet",
    (
        "timm-resnet",
        _is_timm,
        _timm_hparams,
        _torchvision_rules,
        _timm_config,
        _TIMM_LISTING,
        _TIMM_KEYS,
    ),
    ("hf-resnet", _is_hf, _hf_hparams, _hf_rules, _hf_config, _HF_LISTING, _HF_KEYS),
    ignore=_IGNORE,
)

"""What the Hugging Face `config.json` files that zoo's checkpoint families write share: a
transformer's sizes, GELU and LayerNorm epsilon under the family's own key names, without
dropout, and the class labels of a classifier; and what vision families read of an image
processor's `preprocessor_config.json` (its normalisation) and write back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from zoo.models import hparams as model_hparams

from zoo.plugin import ZooError


def transformer_config(
    hparams: Mapping[str, Any], keys: Sequence[str], tanh: str, dropouts: Sequence[str]
) -> dict[str, Any]:
    """The transformer's width, depth, heads, MLP width, activation and epsilon under `keys`
    (the family's names, in that order; the MLP's `mlp_dim` where the model has one, else
    `mlp_ratio` times the width): exact GELU as `gelu`, the tanh approximation as the
    family's `tanh`; each of `dropouts` zero (zoo's exports are for inference and fine-tuning
    as zoo trains them)."""
    width, depth, heads, mlp, activation, epsilon = keys
    return {
        width: hparams["dim"],
        depth: hparams["depth"],
        heads: hparams["num_heads"],
        mlp: hparams.get("mlp_dim") or hparams["dim"] * hparams["mlp_ratio"],
        activation: "gelu" if hparams["exact_gelu"] else tanh,
        epsilon: hparams["norm_epsilon"],
        **dict.fromkeys(dropouts, 0.0),
    }


def class_labels(num_classes: int) -> dict[str, dict]:
    """`id2label` and `label2id` of a classifier with `num_classes` unnamed classes."""
    names = {i: f"LABEL_{i}" for i in range(num_classes)}
    return {
        "id2label": {str(i): name for i, name in names.items()},
        "label2id": {name: i for i, name in names.items()},
    }


PREPROCESSOR = "preprocessor_config.json"
"""The image processor's settings beside a vision checkpoint's `config.json`."""
_STATISTICS = ("image_mean", "image_std", "do_normalize", "do_rescale", "rescale_factor")
_FITTING = (
    "do_resize",
    "size",
    "resample",
    "default_to_square",
    "do_center_crop",
    "crop_size",
    "crop_pct",
    "do_pad",
    "pad_size",
    "do_convert_rgb",
    "data_format",
    "input_data_format",
    "device",
    "return_tensors",
    "disable_grouping",
    "image_seq_length",
    "image_processor_type",
    "feature_extractor_type",
    "processor_class",
)
PREPROCESSOR_HONOURED = tuple(f"preprocessor_config.{key}" for key in _STATISTICS)
"""The image processor's settings a vision family honours: the normalisation statistics and
the rescaling of pixels, which the model's own normalisation takes on."""
PREPROCESSOR_INERT = tuple(f"preprocessor_config.{key}" for key in _FITTING)
"""Its settings that bring an image to the model's input size and format (resizing, cropping,
padding, the colour mode, the output's type): zoo's data sets fit images to the model's
`input_shape` themselves, so they change what the model is given, not what it computes."""


def pixel_statistics(
    config: Mapping[str, Any], mean: Sequence[float], std: Sequence[float]
) -> tuple[list[float], list[float]]:
    """The model's `pixel_mean` and `pixel_std` for pixels in [0, 1], from the image
    processor's settings in `config` (its `preprocessor_config` entry; `mean` and `std` where
    it has none): pixels `rescale_factor` times their 0-255 value (or that value itself,
    `do_rescale=false`), normalised with `image_mean` and `image_std` unless
    `do_normalize=false`. A statistic of the wrong length is refused."""
    processor = config.get("preprocessor_config") or {}
    channels = len(mean)
    if processor.get("do_normalize", True):
        mean = _per_channel(processor, "image_mean", mean, channels)
        std = _per_channel(processor, "image_std", std, channels)
    else:
        mean, std = [0.0] * channels, [1.0] * channels
    rescale = float(processor.get("rescale_factor", 1 / 255))
    scale = 255 * rescale if processor.get("do_rescale", True) else 255.0
    if abs(scale - 1) < 1e-9:  # 255 * (1 / 255) is not exactly 1 in floating point
        return [float(m) for m in mean], [float(s) for s in std]
    return [m / scale for m in mean], [s / scale for s in std]


def _per_channel(
    processor: Mapping[str, Any], key: str, default: Sequence[float], channels: int
) -> list[float]:
    value = processor.get(key, default)
    values = [float(v) for v in value] if isinstance(value, list | tuple) else [float(value)]
    if len(values) == 1:
        values = values * channels
    if len(values) != channels or (key == "image_std" and min(values) <= 0):
        raise ZooError(
            f"This checkpoint's {PREPROCESSOR} has {key}={value!r}: zoo normalises "
            f"{channels}-channel images with one positive statistic per channel."
        )
    return values


def preprocessor_config(
    processor: str,
    size: Mapping[str, int],
    mean: Sequence[float],
    std: Sequence[float],
    input_shape: Sequence[int],
) -> dict[str, Any]:
    """The `preprocessor_config.json` written on export for the image processor `processor`:
    images resized as `size` says (that processor's layout), pixels rescaled from 0-255 to
    [0, 1] and normalised with the statistics the model of `input_shape` uses (a 1-channel
    model's: the averages of three channels')."""
    mean, std = model_hparams.pixel_statistics(list(mean), list(std), list(input_shape))
    return {
        "image_processor_type": processor,
        "do_resize": True,
        "size": dict(size),
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [float(m) for m in mean],
        "image_std": [float(s) for s in std],
    }

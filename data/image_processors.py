"""Image processors of vision-language checkpoints: the pixels a checkpoint's
`preprocessor_config.json` asks for, equal bit for bit to transformers' PIL backend
(`SiglipImageProcessorPil`, `Gemma3ImageProcessorPil`, `Qwen2VLImageProcessorPil`) with the
same Pillow.

`load_image_processor` reads the file (or its dict) and dispatches on `image_processor_type`:
SigLIP, Gemma 3 and Qwen2-VL (which Qwen2.5-VL uses), the name with or without transformers'
`Pil` or `Fast` suffix; any other processor is refused by name. Each step is the one transformers
takes, in its order and dtypes, so the bytes match:

1. Each image becomes uint8 RGB, height x width x 3. A PIL image with transparency (an alpha
   band, or a palette's or RGB's `transparency`) is composited on opaque white, others are
   converted by Pillow; a path or bytes are decoded by Pillow, turned upright by their EXIF
   orientation (as transformers' `load_image` does) and then taken as that PIL image. A uint8
   array (channels last: H x W, or H x W x 1, 3 or 4) is repeated to three channels or, with
   alpha, composited on white by transformers' arithmetic (`round(a * rgb + (1 - a) * 255)`).
   Float arrays are refused: transformers multiplies them by 255 and truncates, so their meaning
   is ambiguous.
2. Gemma 3 only, with `do_pan_and_scan`: crops of an image much wider (or taller) than square,
   each one more image after the original (`num_crops` per image).
3. Resize by Pillow (`Image.resize`, the config's `resample`: 0 nearest, 1 Lanczos, 2 bilinear,
   3 bicubic, 4 box, 5 Hamming) to the config's `size` (SigLIP, Gemma 3) or to Qwen's
   `smart_resize` size: each side a multiple of `patch_size * merge_size`, the area between
   `min_pixels` and `max_pixels`.
4. Rescale in float64, then float32 (`x * rescale_factor`); normalise in float32
   (`(x - image_mean) / image_std`).
5. Qwen only: patch rows as transformers lays them out, one row per patch (`patch_size` square,
   repeated `temporal_patch_size` times), 2x2-merged blocks together, and `grid_thw` per image.

Every key of the config is honoured, inert, or refused by name before any image is processed:
honoured are the steps above (`do_resize`, `size`, `resample`, `do_rescale`, `rescale_factor`,
`do_normalize`, `image_mean`, `image_std`, `do_convert_rgb`, `default_to_square`, Gemma's
`do_pan_and_scan` and `pan_and_scan_*`, Qwen's `min_pixels`, `max_pixels`, `patch_size`,
`temporal_patch_size`, `merge_size`); inert are those that name the processor or transformers'
output format, and settings of steps that are off (`INERT`); `do_center_crop` and `do_pad` are
refused when true, as is any other key. A null value is the processor's default (for Gemma 3
the one `Gemma3Processor` passes). Pixels come back float32 (SigLIP and Gemma 3 as N x H x W x 3,
channels last); `settings()` gives back the config, each honoured key with the value used.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from PIL import Image, ImageOps
from zoo.data.image_examples import DECODE_ERRORS

from zoo.plugin import ZooError

PREPROCESSOR = "preprocessor_config.json"
"""The image processor's settings in a checkpoint's directory."""
PROCESSOR = "processor_config.json"
"""transformers' `ProcessorMixin.save_pretrained` file, its image processor's settings nested
under `image_processor`."""

ImageInput = Image.Image | str | os.PathLike | bytes | np.ndarray
"""An image: a PIL image, a path, the bytes of an image file, or a uint8 array."""

RESAMPLE = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}
"""Pillow's filters (`PIL.Image.Resampling`), by the code a config's `resample` holds."""
INERT = (
    "image_processor_type",
    "processor_class",
    "feature_extractor_type",
    "data_format",
    "input_data_format",
    "device",
    "return_tensors",
    "disable_grouping",
    "crop_size",
    "pad_size",
)
"""Keys that do not change the pixels: the processor's names, transformers' output format and
device (zoo's layout is fixed), and the sizes of centre-cropping and padding, which are off."""
REFUSED_WHEN_TRUE = ("do_center_crop", "do_pad")
COMMON = (
    "do_resize",
    "size",
    "resample",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
    "do_convert_rgb",
)
HALF = (0.5, 0.5, 0.5)
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PAN_AND_SCAN = {  # Gemma3Processor.images_kwargs: what a null in the file becomes
    "do_pan_and_scan": False,
    "pan_and_scan_min_crop_size": 256,
    "pan_and_scan_max_num_crops": 4,
    "pan_and_scan_min_ratio_to_activate": 1.2,
}
QWEN_MIN_PIXELS, QWEN_MAX_PIXELS = 56 * 56, 28 * 28 * 1280
MAX_ASPECT = 200  # Qwen's smart_resize refuses an image whose long side is more times its short


@dataclasses.dataclass(frozen=True)
class ProcessedImages:
    """A batch of images as a vision tower takes them.

    `pixel_values`: float32; SigLIP and Gemma 3 (N, H, W, 3), Gemma's crops after their image;
    Qwen (patches, 3 * temporal_patch_size * patch_size**2), the images' rows one after another.
    `grid_thw`: Qwen's (images, 3) int64 `[1, patch rows, patch columns]`. `num_crops`: Gemma's
    (images,) int64, the pan-and-scan crops that follow each image (0 without)."""

    pixel_values: np.ndarray
    grid_thw: np.ndarray | None = None
    num_crops: np.ndarray | None = None


def load_image_processor(source: str | os.PathLike | Mapping[str, Any]) -> ImageProcessor:
    """The image processor of a checkpoint directory (its `preprocessor_config.json`, else the
    `image_processor` of its `processor_config.json`) or of that file's dict, each key checked
    now, so that a setting zoo cannot honour is refused before any image is processed."""
    config = dict(source) if isinstance(source, Mapping) else _read_config(Path(source))
    name = config.get("image_processor_type")
    base = _base_name(name)
    if base not in PROCESSORS:
        known = ", ".join(PROCESSORS)
        raise ZooError(
            f"The image processor image_processor_type={json.dumps(name)} is not one zoo "
            f"implements: zoo makes the pixels of {known} (each name also with transformers' "
            "'Pil' or 'Fast' suffix). Another checkpoint's images would be prepared differently "
            "from what its model was trained on."
        )
    return PROCESSORS[base](config)


def _read_config(directory: Path) -> dict[str, Any]:
    if (directory / PREPROCESSOR).is_file():
        return json.loads((directory / PREPROCESSOR).read_text())
    if (directory / PROCESSOR).is_file():
        nested = json.loads((directory / PROCESSOR).read_text()).get("image_processor")
        if isinstance(nested, Mapping):
            return dict(nested)
    raise ZooError(
        f"{directory} has no {PREPROCESSOR} (nor a {PROCESSOR} with an image_processor entry): "
        "name the checkpoint directory that holds its image processor's settings."
    )


def _base_name(name: Any) -> Any:
    """transformers 5 names its backends' classes `...ImageProcessorPil` and, before,
    `...ImageProcessorFast`; the settings are the same."""
    if isinstance(name, str):
        for suffix in ("Pil", "Fast"):
            if name.endswith(suffix):
                return name[: -len(suffix)]
    return name


def _refuse(kind: str, key: str, value: Any, valid: str) -> ZooError:
    return ZooError(
        f"The image processor setting {key}={json.dumps(value, default=repr)} ({kind}, {PREPROCESSOR}) "
        f"cannot be honoured: {valid}"
    )


class _Reader:
    """Reads a config's keys, each value checked against what it may be, a null meaning the
    processor's default; remembers the value used, for `settings()`."""

    def __init__(self, kind: str, config: Mapping[str, Any]) -> None:
        self.kind, self.config, self.used = kind, config, {}

    def get(self, key: str, default: Any, check: Callable[[Any], bool], valid: str) -> Any:
        value = self.config.get(key)
        value = default if value is None else value
        if not check(value):
            raise _refuse(self.kind, key, self.config.get(key), valid)
        self.used[key] = value
        return value

    def flag(self, key: str, default: bool) -> bool:
        return self.get(key, default, lambda v: isinstance(v, bool), "it is true, false or null.")

    def count(self, key: str, default: int, least: int = 1) -> int:
        return self.get(
            key, default, lambda v: _is_int(v) and v >= least, f"it is an integer >= {least}."
        )

    def number(self, key: str, default: float) -> float:
        return self.get(key, default, _is_positive, "it is a positive, finite number.")

    def statistic(self, key: str, default: Sequence[float]) -> list[float]:
        """`image_mean` / `image_std`: one number, or one per RGB channel."""
        check = _is_positive if key == "image_std" else _is_number
        value = self.get(
            key,
            default,
            lambda v: (
                check(v) or isinstance(v, list | tuple) and len(v) == 3 and all(map(check, v))
            ),
            "it is one number or a list of 3 (one per RGB channel), image_std's positive.",
        )
        return [float(value)] * 3 if _is_number(value) else [float(v) for v in value]

    def refuse_unknown(self, honoured: Sequence[str], inert: Sequence[str]) -> None:
        """Every key that is neither honoured nor inert, or that turns on a step zoo refuses."""
        for key, value in self.config.items():
            if key in REFUSED_WHEN_TRUE:
                if value not in (None, False):
                    raise _refuse(
                        self.kind,
                        key,
                        value,
                        f"zoo does not {'centre-crop' if key == 'do_center_crop' else 'pad'} "
                        f"images for {self.kind}, whose checkpoints leave that step off; it may be "
                        "false or null.",
                    )
            elif key not in honoured and key not in inert:
                raise _refuse(
                    self.kind,
                    key,
                    value,
                    f"{key} is not a setting of {self.kind} that zoo knows. It honours "
                    f"{', '.join(honoured)}; and leaves {', '.join(inert)} aside.",
                )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_positive(value: Any) -> bool:
    return _is_number(value) and value > 0


class ImageProcessor:
    """The steps every processor shares: images to uint8 RGB, resized, rescaled, normalised.
    Subclasses read their own keys (`_read`) and lay the pixels out (`__call__`)."""

    kind = ""
    own: tuple[str, ...] = ()
    own_inert: tuple[str, ...] = ()
    defaults: ClassVar[Mapping[str, Any]] = {}

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = dict(config)
        reader = _Reader(self.kind, self.config)
        reader.refuse_unknown(COMMON + self.own, INERT + self.own_inert)
        d = self.defaults
        self.do_resize = reader.flag("do_resize", True)
        self.resample = reader.get(
            "resample",
            d["resample"],
            lambda v: _is_int(v) and v in RESAMPLE,
            "it is one of Pillow's filters: "
            + ", ".join(f"{code} ({name})" for code, name in RESAMPLE.items())
            + ".",
        )
        self.do_rescale = reader.flag("do_rescale", True)
        self.rescale_factor = reader.number("rescale_factor", 1 / 255)
        self.do_normalize = reader.flag("do_normalize", True)
        self.image_mean = reader.statistic("image_mean", d["image_mean"])
        self.image_std = reader.statistic("image_std", d["image_std"])
        self.do_convert_rgb = reader.flag("do_convert_rgb", True)
        self._read(reader)
        self._used = reader.used

    def _read(self, reader: _Reader) -> None:
        raise NotImplementedError

    def __call__(self, images: ImageInput | Sequence[ImageInput]) -> ProcessedImages:
        """The pixels of one image or of a list of them, in their order."""
        raise NotImplementedError

    def settings(self) -> dict[str, Any]:
        """The config to write as `preprocessor_config.json` on export: the keys it was loaded
        with, in their order, each honoured key with the value used (a null as its default),
        and the honoured keys it left out, with theirs."""
        return json.loads(json.dumps({**self.config, **self._used}))

    def _rgb(self, images: ImageInput | Sequence[ImageInput]) -> list[np.ndarray]:
        """Each image as uint8 RGB, height x width x 3."""
        if not isinstance(images, list | tuple):
            images = [images]
        if not images:
            raise ZooError(f"{self.kind} was given no images: give one image or a list of them.")
        return [self._one_rgb(image, i) for i, image in enumerate(images)]

    def _one_rgb(self, image: ImageInput, index: int) -> np.ndarray:
        if isinstance(image, np.ndarray):
            return _array_rgb(image, index, self.do_convert_rgb)
        if isinstance(image, str | os.PathLike | bytes | bytearray | memoryview):
            image = _decode(image, index)
        if not isinstance(image, Image.Image):
            raise ZooError(
                f"Image {index} is of type {type(image).__name__}: give a PIL image, a path, the bytes "
                "of an image file, or a uint8 array (height x width, or x 1, 3 or 4 channels)."
            )
        if self.do_convert_rgb:
            return _pil_rgb(image)
        if image.mode != "RGB":
            raise ZooError(
                f"Image {index} is of mode {image.mode} and {self.kind}'s do_convert_rgb=false "
                "leaves it as it is: its model takes RGB. Convert it, or set do_convert_rgb."
            )
        return np.asarray(image)

    def _pixels(self, rgb: np.ndarray, size: tuple[int, int] | None) -> np.ndarray:
        """One image resized to `size` (height, width; none: as it is), rescaled and normalised,
        float32 channels last."""
        if size is not None:
            resized = Image.fromarray(rgb).resize(size[::-1], self.resample, reducing_gap=None)
            rgb = np.asarray(resized)
        x = rgb
        if self.do_rescale:
            x = (rgb.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            x = x.astype(np.float32, copy=False)
            mean = np.asarray(self.image_mean, np.float32)
            x = (x - mean) / np.asarray(self.image_std, np.float32)
        return x.astype(np.float32, copy=False)


def _decode(source: str | os.PathLike | bytes | bytearray | memoryview, index: int) -> Image.Image:
    """A file's image, upright by its EXIF orientation; a file Pillow cannot read is refused."""
    is_bytes = isinstance(source, bytes | bytearray | memoryview)
    name = "its bytes" if is_bytes else os.fspath(source)
    try:
        image = Image.open(io.BytesIO(source) if is_bytes else source)
        image.load()
        return ImageOps.exif_transpose(image)
    except DECODE_ERRORS as error:
        raise ZooError(f"Image {index} ({name}) cannot be decoded by Pillow: {error}") from error


def _pil_rgb(image: Image.Image) -> np.ndarray:
    """transformers' `convert_to_rgb`: transparency composited on opaque white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.asarray(Image.alpha_composite(white, rgba).convert("RGB"))
    return np.asarray(image.convert("RGB"))


def _array_rgb(array: np.ndarray, index: int, convert: bool) -> np.ndarray:
    """transformers' `convert_to_rgb` of a channels-last uint8 array."""
    if array.dtype != np.uint8:
        raise ZooError(
            f"Image {index} is an array of {array.dtype}: give uint8 pixels (0-255). transformers "
            "multiplies a float array by 255 and truncates it, so [0, 1] and [0, 255] floats "
            "would both be guesses; convert it, e.g. (x * 255).round().astype(np.uint8)."
        )
    array = array[..., None] if array.ndim == 2 else array
    if array.ndim != 3 or array.shape[-1] not in (1, 3, 4) or 0 in array.shape:
        raise ZooError(
            f"Image {index} is an array of shape {array.shape}: give height x width, or height "
            "x width x 1, 3 or 4 channels (grey, RGB, RGBA), channels last."
        )
    if array.shape[-1] != 3 and not convert:
        raise ZooError(
            f"Image {index} has {array.shape[-1]} channels and do_convert_rgb=false leaves it "
            "as it is: its model takes RGB. Convert it, or set do_convert_rgb."
        )
    if array.shape[-1] == 1:
        return np.repeat(array, 3, axis=-1)
    if array.shape[-1] == 4:
        alpha = array[..., 3:4] / 255
        return np.round(alpha * array[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    return array


class _FixedSize(ImageProcessor):
    """SigLIP's and Gemma 3's: every image resized to one `size`, the tower's input."""

    def _read(self, reader: _Reader) -> None:
        square = reader.flag("default_to_square", self.defaults["default_to_square"])
        value = reader.config.get("size")
        size = self.defaults["size"] if value is None else value
        if _is_int(size) and size > 0 and square:
            size = {"height": size, "width": size}
        elif isinstance(size, list | tuple) and len(size) == 2:
            size = {"height": size[0], "width": size[1]}
        sides = isinstance(size, Mapping) and set(size) == {"height", "width"}
        if not (sides and all(_is_int(v) and v > 0 for v in size.values())):
            raise _refuse(
                self.kind,
                "size",
                value,
                f'{self.kind}\'s tower takes one size: give {{"height": H, "width": W}}, or one '
                "number with default_to_square true (the size of the square). A shortest or "
                "longest edge would resize each image to its own size.",
            )
        self.size = (size["height"], size["width"])
        reader.used["size"] = {"height": self.size[0], "width": self.size[1]}

    def _stack(self, rgbs: list[np.ndarray]) -> np.ndarray:
        size = self.size if self.do_resize else None
        pixels = [self._pixels(rgb, size) for rgb in rgbs]
        if len({p.shape for p in pixels}) > 1:
            raise ZooError(
                f"{self.kind}'s do_resize=false leaves images at their own size, and these differ "
                f"({', '.join(str(p.shape[:2]) for p in pixels)}): one batch holds one size. "
                "Resize them alike, or set do_resize."
            )
        return np.stack(pixels)


class SiglipImageProcessor(_FixedSize):
    """SigLIP's (`SiglipImageProcessorPil`): resized to `size` (224 x 224 bicubic by
    default), pixels to [-1, 1]."""

    kind = "SiglipImageProcessor"
    own = ("default_to_square",)
    defaults: ClassVar[Mapping[str, Any]] = {
        "resample": 3,
        "image_mean": HALF,
        "image_std": HALF,
        "size": {"height": 224, "width": 224},
        "default_to_square": False,
    }

    def __call__(self, images: ImageInput | Sequence[ImageInput]) -> ProcessedImages:
        return ProcessedImages(self._stack(self._rgb(images)))


class Gemma3ImageProcessor(_FixedSize):
    """Gemma 3's (`Gemma3ImageProcessorPil`): SigLIP's steps (bilinear by default), after
    pan-and-scan where the config asks for it. `image_seq_length` (the image's tokens in the
    prompt) is read by the prompt, not by the pixels."""

    kind = "Gemma3ImageProcessor"
    own = ("default_to_square", *PAN_AND_SCAN)
    own_inert = ("image_seq_length",)
    defaults: ClassVar[Mapping[str, Any]] = {
        **SiglipImageProcessor.defaults,
        "resample": 2,
        "default_to_square": True,
    }

    def _read(self, reader: _Reader) -> None:
        super()._read(reader)
        self.do_pan_and_scan = reader.flag("do_pan_and_scan", PAN_AND_SCAN["do_pan_and_scan"])
        self.min_crop = reader.count(
            "pan_and_scan_min_crop_size", PAN_AND_SCAN["pan_and_scan_min_crop_size"]
        )
        self.max_crops = reader.count(
            "pan_and_scan_max_num_crops", PAN_AND_SCAN["pan_and_scan_max_num_crops"]
        )
        ratio = PAN_AND_SCAN["pan_and_scan_min_ratio_to_activate"]
        self.min_ratio = reader.number("pan_and_scan_min_ratio_to_activate", ratio)

    def __call__(self, images: ImageInput | Sequence[ImageInput]) -> ProcessedImages:
        views, num_crops = [], []
        for rgb in self._rgb(images):
            crops = []
            if self.do_pan_and_scan:
                crops = pan_and_scan(rgb, self.min_crop, self.max_crops, self.min_ratio)
            views += [rgb, *crops]
            num_crops.append(len(crops))
        return ProcessedImages(self._stack(views), num_crops=np.asarray(num_crops, np.int64))


def pan_and_scan(
    rgb: np.ndarray, min_crop: int, max_crops: int, min_ratio: float
) -> list[np.ndarray]:
    """Gemma 3's crops of an image (height x width x channels) much wider than tall, or taller
    than wide: about as many as its aspect ratio (at least 2, at most `max_crops`, each at least
    `min_crop` pixels across), side by side from its left (top), the last one narrower; none
    for an image within `min_ratio` of square or whose crops would be too small."""
    height, width = rgb.shape[:2]
    long, short = max(height, width), min(height, width)
    if long / short < min_ratio:
        return []
    count = math.floor(long / short + 0.5)
    count = min(max_crops, max(2, min(math.floor(long / min_crop), count)))
    across = math.ceil(long / count)
    if min(across, short) < min_crop:
        return []
    if width >= height:
        return [rgb[:, i * across : (i + 1) * across] for i in range(count)]
    return [rgb[i * across : (i + 1) * across] for i in range(count)]


class Qwen2VLImageProcessor(ImageProcessor):
    """Qwen2-VL's and Qwen2.5-VL's (`Qwen2VLImageProcessorPil`): each image resized to its own
    size (`smart_resize`), then cut into patch rows."""

    kind = "Qwen2VLImageProcessor"
    own = ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size")
    own_inert = ("default_to_square",)  # an int `size` is refused either way
    defaults: ClassVar[Mapping[str, Any]] = {
        "resample": 3,
        "image_mean": OPENAI_CLIP_MEAN,
        "image_std": OPENAI_CLIP_STD,
    }

    def _read(self, reader: _Reader) -> None:
        self.patch = reader.count("patch_size", 14)
        self.temporal = reader.count("temporal_patch_size", 2)
        self.merge = reader.count("merge_size", 2)
        value = reader.config.get("size")
        size = {"shortest_edge": QWEN_MIN_PIXELS, "longest_edge": QWEN_MAX_PIXELS}
        if isinstance(value, Mapping):
            size = dict(value)
        elif value is not None:
            size = None
        for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if size is not None and reader.config.get(key) is not None:
                size[edge] = reader.count(key, 1)
        edges = size is not None and set(size) == {"shortest_edge", "longest_edge"}
        if not (edges and all(_is_int(v) and v > 0 for v in size.values())):
            raise _refuse(
                self.kind,
                "size",
                value,
                'give {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS} (the least and '
                "most pixels of a resized image), or min_pixels and max_pixels.",
            )
        self.min_pixels, self.max_pixels = size["shortest_edge"], size["longest_edge"]
        if self.min_pixels > self.max_pixels:
            raise _refuse(
                self.kind,
                "size",
                size,
                f"its least pixels ({self.min_pixels}) exceed its most ({self.max_pixels}).",
            )
        reader.used["size"] = size

    def __call__(self, images: ImageInput | Sequence[ImageInput]) -> ProcessedImages:
        rows, grids = [], []
        for index, rgb in enumerate(self._rgb(images)):
            size = self._size(rgb.shape[:2], index)
            pixels = self._pixels(rgb, size if self.do_resize else None)
            rows.append(patchify(pixels, self.patch, self.merge, self.temporal))
            grids.append([1, size[0] // self.patch, size[1] // self.patch])
        return ProcessedImages(np.concatenate(rows), grid_thw=np.asarray(grids, np.int64))

    def _size(self, shape: tuple[int, int], index: int) -> tuple[int, int]:
        factor = self.patch * self.merge
        if max(shape) / min(shape) > MAX_ASPECT:
            raise ZooError(
                f"Image {index} is {shape[0]} x {shape[1]} pixels: {self.kind} takes images whose "
                f"long side is at most {MAX_ASPECT} times the short one, as transformers' "
                "smart_resize does."
            )
        if self.do_resize:
            return smart_resize(*shape, factor, self.min_pixels, self.max_pixels)
        if shape[0] % factor or shape[1] % factor:
            raise ZooError(
                f"Image {index} is {shape[0]} x {shape[1]} pixels and {self.kind}'s "
                f"do_resize=false leaves it so; its sides must then be multiples of patch_size "
                f"x merge_size = {factor}. Resize it, or set do_resize."
            )
        return shape


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen2-VL's size for an image: each side rounded to a multiple of `factor` (Python's
    half-to-even `round`, as transformers), then scaled, keeping the aspect ratio, into
    [`min_pixels`, `max_pixels`]."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def patchify(pixels: np.ndarray, patch: int, merge: int, temporal: int) -> np.ndarray:
    """Qwen's rows of an image (height x width x channels): one per `patch` square, the
    `merge` x `merge` blocks' patches together (block row, block column, row, column in it), each
    row the patch's (channel, time, y, x) values, repeated `temporal` times as a still image is."""
    chw = np.asarray(pixels, np.float32).transpose(2, 0, 1)
    channels, height, width = chw.shape
    gh, gw = height // patch, width // patch
    blocks = chw.reshape(channels, gh // merge, merge, patch, gw // merge, merge, patch)
    blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)
    shape = (*blocks.shape[:5], temporal, *blocks.shape[5:])
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], shape)
    return frames.reshape(gh * gw, channels * temporal * patch * patch)


PROCESSORS: dict[str, type[ImageProcessor]] = {
    cls.kind: cls for cls in (SiglipImageProcessor, Gemma3ImageProcessor, Qwen2VLImageProcessor)
}
"""The image processors zoo implements, by transformers' name without its backend's suffix."""

"""One image, from encoded bytes (or an array) to the uint8 pixels a model sees.

Decoding is Pillow's; any mode (L, RGB, RGBA, P, CMYK, 16-bit) becomes the model's channels:
`L` for one, `RGB` for three (transparency is dropped, as Pillow's conversion does).

- Eval: the shorter side resized to `size`, then the centre `size` x `size` crop.
- Training (`basic`): a random-resized crop (an area of 8% to 100% of the image, an aspect ratio
  between 3/4 and 4/3, resized to `size` x `size`; torchvision's `RandomResizedCrop`) and a
  left-right flip with probability 1/2. `strong` adds random brightness, contrast and
  saturation (each a factor drawn from [0.6, 1.4]). `none`: the eval view.

Every draw comes from the generator the caller seeds from (seed, example, epoch).
"""

from __future__ import annotations

import enum
import io
import math

import numpy as np
from PIL import Image, ImageEnhance

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")

_SCALE = (0.08, 1.0)
_LOG_RATIO = (math.log(3 / 4), math.log(4 / 3))
_JITTER = 0.4


class Augment(str, enum.Enum):
    none = "none"
    basic = "basic"
    strong = "strong"


def open_image(payload: bytes | np.ndarray | str) -> Image.Image:
    """A decoded image: from a file's path, its bytes, or an array (H x W or H x W x C)."""
    if isinstance(payload, np.ndarray):
        return Image.fromarray(np.ascontiguousarray(payload))
    image = Image.open(payload if isinstance(payload, str) else io.BytesIO(payload))
    image.load()  # decode now: a truncated or corrupt file fails here, not later
    return image


def to_channels(image: Image.Image, channels: int) -> Image.Image:
    mode = "L" if channels == 1 else "RGB"
    if image.mode == mode:
        return image
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):  # 16/32-bit grey: scale to 8 bits
        pixels = np.asarray(image, np.float64)
        image = Image.fromarray((pixels * 255 / max(pixels.max(), 1)).astype(np.uint8))
    return image.convert(mode)


def eval_view(image: Image.Image, size: int) -> Image.Image:
    """Shorter side resized to `size`, then the centre square."""
    width, height = image.size
    scale = size / min(width, height)
    crop_w, crop_h = size / scale, size / scale
    left, top = (width - crop_w) / 2, (height - crop_h) / 2
    return image.resize((size, size), Image.BILINEAR, box=(left, top, left + crop_w, top + crop_h))


def random_resized_crop(image: Image.Image, size: int, rng: np.random.Generator) -> Image.Image:
    """torchvision's RandomResizedCrop: up to ten tries at a crop of a random area and aspect
    ratio that fits; else the centre crop of the largest allowed ratio."""
    width, height = image.size
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(*_SCALE)
        ratio = math.exp(rng.uniform(*_LOG_RATIO))
        w = round(math.sqrt(target * ratio))
        h = round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return image.resize((size, size), Image.BILINEAR, box=(left, top, left + w, top + h))
    ratio = width / height
    if ratio < 3 / 4:
        w, h = width, round(width * 4 / 3)
    elif ratio > 4 / 3:
        w, h = round(height * 4 / 3), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return image.resize((size, size), Image.BILINEAR, box=(left, top, left + w, top + h))


def _jitter(image: Image.Image, rng: np.random.Generator) -> Image.Image:
    factors = rng.uniform(1 - _JITTER, 1 + _JITTER, size=3)
    image = ImageEnhance.Brightness(image).enhance(factors[0])
    image = ImageEnhance.Contrast(image).enhance(factors[1])
    if image.mode == "RGB":
        image = ImageEnhance.Color(image).enhance(factors[2])
    return image


def pixels(
    image: Image.Image,
    size: int,
    channels: int,
    augment: Augment,
    rng: np.random.Generator | None,
) -> np.ndarray:
    """uint8 `size` x `size` x `channels`: the eval view (`rng` None or `augment` none), or a
    training view drawn from `rng`."""
    image = to_channels(image, channels)
    if rng is None or augment == Augment.none:
        view = eval_view(image, size)
    else:
        view = random_resized_crop(image, size, rng)
        if rng.random() < 0.5:
            view = view.transpose(Image.FLIP_LEFT_RIGHT)
        if augment == Augment.strong:
            view = _jitter(view, rng)
    return np.asarray(view, np.uint8).reshape(size, size, channels)

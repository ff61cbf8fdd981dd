"""Labelled images made one at a time: decoded, converted, augmented, stacked into a batch.

The images come from `Payloads`: files of a folder, records of ArrayRecord shards, cells of a
Parquet column. Each one goes from encoded bytes (or an array) to the uint8 pixels a model
sees. Decoding is Pillow's; any mode (L, RGB, RGBA, P, CMYK, 16-bit) becomes the model's
channels: `L` for one, `RGB` for three (transparency is dropped, as Pillow's conversion does).

- Eval: the shorter side resized to `size`, then the centre `size` x `size` crop.
- Training (`basic`): a random-resized crop (an area of 8% to 100% of the image, an aspect ratio
  between 3/4 and 4/3, resized to `size` x `size`; torchvision's `RandomResizedCrop`) and a
  left-right flip with probability 1/2. `strong` adds random brightness, contrast and
  saturation (each a factor drawn from [0.6, 1.4]). `none`: the eval view.

Every draw comes from a generator seeded from (seed, example, epoch). What cannot be decoded is
handled by `data.on_error`:

- `skip` (default): before training, each image's header is read and the ones that are not
  images are left out, each named in a warning, and their count logged. A file whose header
  reads but whose body does not (a truncated JPEG) is found only when it is decoded: it is
  replaced, in that batch, by the next example that decodes, with a warning naming it.
- `raise`: before training every image is decoded once; any that fails stops the run, naming
  them all. This costs one pass over the data.
"""

from __future__ import annotations

import enum
import hashlib
import io
import json
import logging
import math
import os
from collections.abc import Sequence
from typing import Protocol

import numpy as np
from PIL import Image, ImageEnhance, UnidentifiedImageError
from zoo.data.files import cache_root

from zoo.plugin import Batch, ExampleSource, ZooError

log = logging.getLogger("zoo")

DECODE_ERRORS = (OSError, UnidentifiedImageError, ValueError, SyntaxError, EOFError)
"""What Pillow raises on a corrupt, truncated or non-image file."""

STATS_SAMPLE = 1000
"""Images (a fixed sample of the training split) that the data set's statistics come from."""

_SCALE = (0.08, 1.0)
_LOG_RATIO = (math.log(3 / 4), math.log(4 / 3))
_JITTER = 0.4


class Augment(str, enum.Enum):
    none = "none"
    basic = "basic"
    strong = "strong"


OnError = enum.Enum("OnError", {"skip": "skip", "raise": "raise"}, type=str)
"""A bad row or file: `skip` it with a warning, or `raise`: stop, naming them all. Made by the
functional API, so that the config's `data.on_error=raise` names a member (`raise` is no
identifier for a class body)."""
RAISE = OnError["raise"]


# ---- One image: decoded, then the view a model sees ----


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


# ---- Where a split's images are, and which of them can be decoded ----


class Payloads(Protocol):
    """Where a split's encoded images are: `read(i)` gives the i-th one (a path, bytes or an
    array), `name(i)` what a message calls it."""

    def __len__(self) -> int: ...

    def read(self, index: int) -> bytes | np.ndarray | str: ...

    def name(self, index: int) -> str: ...


class Files:
    """Image files, by path."""

    def __init__(self, paths: Sequence[str]):
        self.paths = list(paths)

    def __len__(self) -> int:
        return len(self.paths)

    def read(self, index: int) -> str:
        return self.paths[index]

    def name(self, index: int) -> str:
        return self.paths[index]


class Subset:
    """Some of another `Payloads`' images, in the order of `indices`."""

    def __init__(self, payloads: Payloads, indices: Sequence[int]):
        self.payloads, self.indices = payloads, np.asarray(indices, np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def read(self, index: int) -> bytes | np.ndarray | str:
        return self.payloads.read(int(self.indices[index]))

    def name(self, index: int) -> str:
        return self.payloads.name(int(self.indices[index]))


def _readable(payload: bytes | np.ndarray | str, decode: bool) -> bool:
    """Whether Pillow recognises the image (`decode`: and decodes all of it)."""
    if isinstance(payload, np.ndarray):
        return payload.dtype == np.uint8 and payload.ndim in (2, 3)
    try:
        if decode:
            open_image(payload)
        else:
            with Image.open(payload if isinstance(payload, str) else io.BytesIO(payload)):
                pass
        return True
    except DECODE_ERRORS:
        return False


def readable(payloads: Payloads, on_error: OnError, where: str) -> list[int]:
    """The indices of the images that can be used, by `on_error` (see the module's doc)."""
    decode = on_error == RAISE
    bad = [i for i in range(len(payloads)) if not _readable(payloads.read(i), decode)]
    if bad and decode:
        names = ", ".join(payloads.name(i) for i in bad[:10])
        raise ZooError(
            f"{len(bad)} of the {len(payloads):,} images of {where} cannot be decoded "
            f"(data.on_error=raise): {names}{', ...' if len(bad) > 10 else ''}. Remove or "
            "replace them, or let data.on_error=skip leave them out."
        )
    for i in bad:
        log.warning("Skipping %s: not an image that can be decoded", payloads.name(i))
    if bad:
        log.warning(
            "Skipped %d of the %d images of %s that cannot be decoded.",
            len(bad),
            len(payloads),
            where,
        )
    bad_set = set(bad)
    return [i for i in range(len(payloads)) if i not in bad_set]


# ---- The examples of a split ----


class ImageExamples(ExampleSource):
    """`image` (uint8 size x size x channels) and `label` (int32) per example."""

    def __init__(
        self,
        payloads: Payloads,
        labels: np.ndarray,
        size: int,
        channels: int,
        augment: Augment,
    ):
        self.payloads, self.labels = payloads, np.asarray(labels, np.int32)
        self.size, self.channels, self.augment = size, channels, augment
        self._skipped = 0

    def __len__(self) -> int:
        return len(self.payloads)

    def examples(self, rows: np.ndarray, epochs: np.ndarray | None, seed: int) -> Batch:
        images = np.empty((len(rows), self.size, self.size, self.channels), np.uint8)
        labels = np.empty(len(rows), np.int32)
        for i, row in enumerate(rows):
            rng = None if epochs is None else np.random.default_rng([seed, row, epochs[i]])
            images[i], labels[i] = self._example(int(row), rng)
        return {"image": images, "label": labels}

    def _example(self, row: int, rng: np.random.Generator | None) -> tuple[np.ndarray, int]:
        """The example `row`, or, if it cannot be decoded, the next one that can."""
        for offset in range(len(self)):
            index = (row + offset) % len(self)
            try:
                image = open_image(self.payloads.read(index))
            except DECODE_ERRORS as e:
                self._skipped += 1
                log.warning(
                    "Skipping %s (%s): it cannot be decoded; %d skipped so far in this process.",
                    self.payloads.name(index),
                    e,
                    self._skipped,
                )
                continue
            return pixels(image, self.size, self.channels, self.augment, rng), self.labels[index]
        raise ZooError("No image of this split can be decoded.")

    def statistics(self, fingerprint: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """Per-channel mean and std of intensities in [0, 1], over the eval views of a fixed
        sample of `STATS_SAMPLE` examples; cached under the data cache by `fingerprint`."""
        key = hashlib.sha256(
            f"{fingerprint}|{self.size}|{self.channels}|{STATS_SAMPLE}".encode()
        ).hexdigest()
        cached = cache_root() / "image-statistics" / f"{key}.json"
        if cached.is_file():
            stats = json.loads(cached.read_text())
            return tuple(stats["mean"]), tuple(stats["std"])
        order = np.random.default_rng(0).permutation(len(self))[:STATS_SAMPLE]
        images = self.examples(np.sort(order), None, 0)["image"].astype(np.float64) / 255
        mean = images.mean(axis=(0, 1, 2))
        std = np.maximum(images.std(axis=(0, 1, 2)), 1e-3)
        stats = {"mean": [float(m) for m in mean], "std": [float(s) for s in std]}
        _write_quietly(cached, json.dumps(stats))
        return tuple(stats["mean"]), tuple(stats["std"])


def _write_quietly(path, text: str) -> None:
    """A cache entry, written whole or not at all (a cache that cannot be written is no error)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.part")
        temporary.write_text(text)
        os.replace(temporary, path)
    except OSError:
        pass

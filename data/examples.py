"""Labelled images made one at a time: decoded, converted, augmented, stacked into a batch.

The images come from `Payloads`: files of a folder, records of ArrayRecord shards, cells of a
Parquet column. What cannot be decoded is handled by `data.on_error`:

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
import os
from collections.abc import Sequence
from typing import Protocol

import numpy as np
from PIL import Image, UnidentifiedImageError
from zoo.data.files import cache_root
from zoo.data.imaging import Augment, open_image, pixels

from zoo.plugin import Batch, ExampleSource, ZooError

log = logging.getLogger("zoo")

DECODE_ERRORS = (OSError, UnidentifiedImageError, ValueError, SyntaxError, EOFError)
"""What Pillow raises on a corrupt, truncated or non-image file."""

STATS_SAMPLE = 1000
"""Images (a fixed sample of the training split) that the data set's statistics come from."""

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class OnError(str, enum.Enum):
    skip = "skip"
    raise_ = "raise"


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
    decode = on_error == OnError.raise_
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


class NormalizeBy(str, enum.Enum):
    """How pixels become a model's inputs: standardised by the training images' statistics or
    ImageNet's, or (`none`) only scaled to [0, 1], for a model that normalises them itself."""

    dataset = "dataset"
    imagenet = "imagenet"
    none = "none"


def held_out(labels: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, eval) indices: of each class, `fraction` of its examples (at least one, when it
    has two or more) held out, chosen by a fixed seed: the same split on every machine."""
    train, test = [], []
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        members = members[np.random.default_rng([0, int(label)]).permutation(len(members))]
        count = min(max(round(fraction * len(members)), 1), len(members) - 1)
        test.append(members[:count])
        train.append(members[count:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def check_image_keys(
    *,
    image_size: int = 32,
    channels: int = 3,
    workers: int = 0,
    eval_fraction: float = 0.1,
    num_classes: int | None = None,
    **_: object,
) -> None:
    """The keys that `data=images`, `arrayrecord` and `parquet` share (given as their config
    is, the others ignored), each refused by name. Their `describe` runs this first: a model
    sized from a bad `image_size` would otherwise be refused under its own key
    (`model.input_shape`)."""
    if image_size < 1:
        raise ZooError(
            f"data.image_size={image_size} must be at least 1: the side, in pixels, of the "
            "square that every image is resized to (e.g. 32)."
        )
    if channels not in (1, 3):
        raise ZooError(f"data.channels={channels} must be 1 (grey) or 3 (RGB).")
    if workers < 0:
        raise ZooError(
            f"data.workers={workers} must be 0 (decode in the training process) or a number "
            "of worker processes."
        )
    if not 0 < eval_fraction < 1:
        raise ZooError(
            f"data.eval_fraction={eval_fraction} must be between 0 and 1 (exclusive): the share "
            "of each class held out for evaluation when there is no val/ split."
        )
    if num_classes is not None and num_classes < 1:
        raise ZooError(
            f"data.num_classes={num_classes} must be at least 1, or null to count the classes "
            "(the class names, or the largest label + 1)."
        )

"""The keys that the data sets of labelled images (`data=images`, `arrayrecord`, `parquet`)
share, defined once in `ImageOptions`, and what they decide: the examples held out for
evaluation, and how pixels are normalised.

A loader takes them as one parameter, `options: ImageOptions`: the registry makes its fields
keys of the data set, after the loader's own (`zoo.engine.registry.options_parameters`), and builds the
options from them, checked, before the loader runs; the config reference documents each key by
the comment of its field here.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from zoo.data.builtin_images import Normalize
from zoo.data.image_examples import Augment, ImageExamples, OnError, Payloads

from zoo.plugin import Splits, ZooError

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class NormalizeBy(str, enum.Enum):
    """How pixels become a model's inputs: standardised by the training images' statistics or
    ImageNet's, or (`none`) only scaled to [0, 1], for a model that normalises them itself."""

    dataset = "dataset"
    imagenet = "imagenet"
    none = "none"


@dataclasses.dataclass(frozen=True)
class ImageOptions:
    """How a split's images become examples; each value is checked, and refused by its key,
    when the options are made."""

    # Side, in pixels, of the square every image is resized and cropped to.
    image_size: int = 32
    channels: int = 3  # 1: grey, 3: RGB
    # Training images: `none`, `basic` (a random-resized crop, flipped left-right half the time) or
    # `strong` (and random brightness, contrast and saturation).
    augment: Augment = Augment.basic
    # Per channel: `dataset` by the training images' mean and std, `imagenet` by ImageNet's, `none`
    # not at all (intensities in [0, 1], for a model that normalises its inputs itself).
    normalize: NormalizeBy = NormalizeBy.dataset
    # Share of each class held out for evaluation (at least one image) when there is no `val/`
    # split.
    eval_fraction: float = 0.1
    workers: int = 0  # processes making the training batches; 0: the training process
    # An image that cannot be decoded: `skip` it with a warning, or `raise`: decode every image
    # before training and stop, naming each one that fails.
    on_error: OnError = OnError.skip

    def __post_init__(self) -> None:
        if self.image_size < 1:
            raise ZooError(
                f"data.image_size={self.image_size} must be at least 1: the side, in pixels, of "
                "the square that every image is resized to (e.g. 32)."
            )
        if self.channels not in (1, 3):
            raise ZooError(f"data.channels={self.channels} must be 1 (grey) or 3 (RGB).")
        if self.workers < 0:
            raise ZooError(
                f"data.workers={self.workers} must be 0 (decode in the training process) or a "
                "number of worker processes."
            )
        if not 0 < self.eval_fraction < 1:
            raise ZooError(
                f"data.eval_fraction={self.eval_fraction} must be between 0 and 1 (exclusive): "
                "the share of each class held out for evaluation when there is no val/ split."
            )

    @classmethod
    def of(cls, keys: Mapping[str, Any]) -> ImageOptions:
        """The options among a data set's keys (the others ignored), checked: a `describe`
        makes them first, since a model sized from a bad `image_size` would otherwise be
        refused under its own key (`model.input_shape`)."""
        return cls(**{name: keys[name] for name in _NAMES if name in keys})

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return self.image_size, self.image_size, self.channels

    def examples(self, payloads: Payloads, labels: np.ndarray, augment: Augment) -> ImageExamples:
        """The examples of `payloads`, viewed as these options say (`augment`: the training
        split's `self.augment`, or `none` for evaluation)."""
        return ImageExamples(payloads, labels, self.image_size, self.channels, augment)


_NAMES = tuple(field.name for field in dataclasses.fields(ImageOptions))


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


def _fingerprint(paths: list[str]) -> str:
    """Names, sizes and modification times of the files: changes when any of them does."""
    digest = hashlib.sha256()
    for path in paths:
        stat = Path(path).stat()
        digest.update(f"{path}|{stat.st_size}|{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def image_splits(
    train: ImageExamples,
    test: ImageExamples,
    options: ImageOptions,
    files: list[str],
    class_names: list[str] | None,
) -> Splits:
    """The splits, normalised by the training images' statistics (cached by the names, sizes
    and times of `files`) or ImageNet's, or only scaled to [0, 1]; `class_names`: of labels
    0, 1, ..., where the data names them."""
    if options.normalize == NormalizeBy.imagenet:
        mean, std = IMAGENET_MEAN, IMAGENET_STD
        mean, std = (mean, std) if train.channels == 3 else ((np.mean(mean),), (np.mean(std),))
    elif options.normalize == NormalizeBy.none:
        mean, std = (0.0,) * train.channels, (1.0,) * train.channels
    else:
        mean, std = train.statistics(_fingerprint(files))
    return Splits(
        train=train,
        eval=test,
        transform=Normalize(255, mean, std),
        workers=options.workers,
        class_names=class_names,
    )

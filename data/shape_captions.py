"""Coloured shapes and their captions: small image-text pairs for a contrastive model (siglip)
to learn from in seconds.

Each image (16 x 16 x 3, float32 in [-1, 1], as SigLIP's image processor makes pixels) is a
noisy dark background with one shape in one colour at a random place; its caption is the token
ids `[colour, shape, end, end]` of a fixed vocabulary of 8 (`VOCABULARY`: 0 ends a caption,
then the colours, then the shapes), the end padding the caption as SigLIP's `</s>` does.
"""

from __future__ import annotations

import numpy as np

from zoo.plugin import Splits, ZooError, register_data

COLOURS = {"red": (1.0, -1.0, -1.0), "green": (-1.0, 1.0, -1.0), "blue": (-1.0, -1.0, 1.0)}
COLOURS["yellow"] = (1.0, 1.0, -1.0)
SHAPES = {"square": (6, 6), "wide bar": (3, 12), "tall bar": (12, 3)}
VOCABULARY = ("<end>", *COLOURS, *SHAPES)
"""The captions' tokens, by id."""
SIDE, LENGTH = 16, 4


def _pairs(size: int, seed: int) -> dict[str, np.ndarray]:
    """`size` images with their captions, drawn from `seed`."""
    rng = np.random.default_rng(seed)
    colours = rng.integers(0, len(COLOURS), size)
    shapes = rng.integers(0, len(SHAPES), size)
    images = rng.uniform(-1.0, -0.6, (size, SIDE, SIDE, 3)).astype(np.float32)
    for image, colour, shape in zip(images, colours, shapes, strict=True):
        height, width = list(SHAPES.values())[shape]
        top, left = rng.integers(0, SIDE - height + 1), rng.integers(0, SIDE - width + 1)
        image[top : top + height, left : left + width] = list(COLOURS.values())[colour]
    tokens = np.zeros((size, LENGTH), np.int32)
    tokens[:, 0], tokens[:, 1] = 1 + colours, 1 + len(COLOURS) + shapes
    return {"image": images, "tokens": tokens}


@register_data("shape_captions", input_shape=(SIDE, SIDE, 3))
def shape_captions(
    train_size: int = 2048,  # training pairs
    eval_size: int = 256,  # eval pairs
    train_seed: int = 42,  # seed of the training pairs (the run's `seed` does not change them)
    eval_seed: int = 123,  # seed of the eval pairs
) -> Splits:
    for key, size in (("train_size", train_size), ("eval_size", eval_size)):
        if size < 1:
            raise ZooError(f"data.{key}={size} must be at least 1: the number of pairs.")
    return Splits(train=_pairs(train_size, train_seed), eval=_pairs(eval_size, eval_seed))

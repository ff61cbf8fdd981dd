"""Continuous XOR: noisy points around the corners of the unit square, label = x XOR y."""

from __future__ import annotations

import math

import numpy as np

from zoo.plugin import Splits, ZooError, register_data


def _continuous_xor(size: int, noise: float, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    corners = rng.integers(0, 2, size=(size, 2))
    label = (corners.sum(axis=1) == 1).astype(np.int32)
    inputs = corners + noise * rng.standard_normal((size, 2))
    return {"inputs": inputs.astype(np.float32), "label": label}


@register_data("xor")
def xor(
    train_size: int = 2500,  # training points
    eval_size: int = 500,  # eval points
    noise: float = 0.1,  # standard deviation of the Gaussian noise around each corner
    train_seed: int = 42,  # seed of the training points (the run's `seed` does not change them)
    eval_seed: int = 123,  # seed of the eval points
) -> Splits:
    for key, size, split in (
        ("train_size", train_size, "training"),
        ("eval_size", eval_size, "eval"),
    ):
        if size < 1:
            raise ZooError(f"data.{key}={size} must be at least 1: the number of {split} points.")
    if not 0 <= noise < math.inf:
        raise ZooError(
            f"data.noise={noise} must be finite and 0 or more: the standard deviation of the "
            "points around their corner."
        )
    return Splits(
        train=_continuous_xor(train_size, noise, train_seed),
        eval=_continuous_xor(eval_size, noise, eval_seed),
    )

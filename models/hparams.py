"""Checks of a model's constructor arguments, so that a size of 0 or a dropout rate of 2 from
the command line stops with its config key named instead of a shape error deep in JAX."""

from __future__ import annotations

import math
from collections.abc import Sequence

from zoo.plugin import ZooError


def positive(model: str, **sizes: int | Sequence[int] | None) -> None:
    """Every size (or every entry of a list of sizes) is at least 1."""
    for key, value in sizes.items():
        values = value if isinstance(value, Sequence) else [value]
        if not values or any(not isinstance(v, int) or v < 1 for v in values):
            what = (
                "a list of sizes of at least 1 each"
                if isinstance(value, Sequence)
                else "at least 1"
            )
            raise ZooError(f"model.{key}={_shown(value)} must be {what} ({model}).")


def rates(model: str, **values: float) -> None:
    """Every dropout rate lies in [0, 1)."""
    for key, value in values.items():
        if not (math.isfinite(value) and 0 <= value < 1):
            raise ZooError(f"model.{key}={value} must be a rate in [0, 1) ({model}).")


def choice(model: str, **choices: tuple[str, Sequence[str]]) -> None:
    """Every value (first of each pair) is one of its valid choices (second)."""
    for key, (value, valid) in choices.items():
        if value not in valid:
            raise ZooError(
                f"model.{key}={value!r} is not a {model} {key}: choose one of {', '.join(valid)}."
            )


def pixel_statistics(
    mean: list[float] | None, std: list[float] | None, input_shape: list[int]
) -> tuple[tuple[float, ...] | None, tuple[float, ...] | None]:
    """The per-channel mean and std the model normalises its inputs with (both or neither). A
    1-channel model given three channels' statistics (RGB weights on grayscale images, their
    stem summed over its input channels) uses their averages."""
    if mean is None and std is None:
        return None, None
    channels = input_shape[-1]
    if mean is not None and std is not None and channels == 1 and len(mean) == len(std) == 3:
        mean, std = [sum(mean) / 3], [sum(std) / 3]
    if (
        mean is None
        or std is None
        or len(mean) != channels
        or len(std) != channels
        or min(std) <= 0
    ):
        raise ZooError(
            f"model.pixel_mean={mean} and model.pixel_std={std} must be given together, one "
            f"value per input channel ({channels}), every std above 0."
        )
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)


def _shown(value: object) -> str:
    return str(list(value)) if isinstance(value, Sequence) else str(value)

"""The checks that the options of post-training's losses share: each refuses a bad value with a
`ZooError` naming it and what would be valid."""

from __future__ import annotations

import math
from collections.abc import Sequence

from zoo.engine.errors import ZooError


def number(value: object) -> bool:
    """Whether `value` is a finite real number (a bool is not one)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def choice(key: str, value: object, choices: Sequence[str], what: str) -> None:
    """Refuse `value` unless it is one of `choices` (`what` they are)."""
    if value not in choices:
        raise ZooError(f"{key}={value!r} is not {what}: choose one of {', '.join(choices)}.")

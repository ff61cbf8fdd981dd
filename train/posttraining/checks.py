"""The checks that the options of post-training's losses share: each refuses a bad value with a
`ZooError` naming it and what would be valid."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from zoo.engine.errors import ZooError


def number(value: object) -> bool:
    """Whether `value` is a finite real number (a bool is not one)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def choice(key: str, value: object, choices: Sequence[str], what: str) -> None:
    """Refuse `value` unless it is one of `choices` (`what` they are)."""
    if value not in choices:
        raise ZooError(f"{key}={value!r} is not {what}: choose one of {', '.join(choices)}.")


def options_from(cls: type, section: Mapping[str, Any], prefix: str) -> Any:
    """`cls(**section)`, its refusal naming the config's keys (`prefix` + field) rather than the
    bare fields."""
    try:
        return cls(**section)
    except ZooError as e:
        message = str(e)
        for field in dataclasses.fields(cls):
            message = re.sub(rf"(?<![\w.]){field.name}=", f"{prefix}{field.name}=", message)
        raise ZooError(message) from None

"""Path patterns: naming parts of a model by the dotted paths of its params and modules.

A param's path is its attribute path, dotted: `blocks.0.conv.kernel`, `head.bias`. A pattern is
a regex that names a module or a param by a whole path or a leading part of it, component by
component: `head` matches `head.kernel` and `head.bias` (not `heads.x`), `blocks` every param of
every block, `blocks\\.[01]` the first two, `.*norm` every param of every module whose name ends
in `norm`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from flax import nnx

BACKBONE = "backbone"
"""The freeze pattern that names every param outside the model's head."""


def dotted(path: Sequence[Any]) -> str:
    return ".".join(str(part) for part in path)


def matches(pattern: str, path: Sequence[Any] | str) -> bool:
    text = path if isinstance(path, str) else dotted(path)
    return re.fullmatch(rf"(?:{pattern})(?:\..*)?", text) is not None


def matching(pattern: str) -> nnx.filterlib.Filter:
    """An NNX filter of the variables whose path `pattern` matches."""

    def predicate(path: Sequence[Any], _: Any) -> bool:
        return matches(pattern, path)

    predicate.__qualname__ = f"matching({pattern!r})"  # how the filter shows in messages
    return predicate


def outside(pattern: str) -> nnx.filterlib.Filter:
    """An NNX filter of the variables whose path `pattern` does not match."""
    return nnx.Not(matching(pattern))

"""The one exception type that zoo raises for bad input.

The CLI prints a `ZooError` as a single paragraph and exits non-zero, without a traceback: the
message itself must name the bad value and what would be valid.
"""

from collections.abc import Sequence


class ZooError(ValueError):
    """Bad input from the user: an unknown name, a wrong key or type, missing data."""


class NonFiniteLoss(ZooError):
    """The training loss became NaN or Inf under `trainer.nan_policy=stop`."""


class CorruptCheckpoint(ZooError):
    """A checkpoint whose arrays read back differently from how they were saved."""


class SaveFailed(ZooError):
    """A checkpoint could not be written (permission, full disk, I/O error)."""


def mismatches(*kinds: tuple[str, Sequence[str]]) -> str:
    """What does not fit, as one clause for an error message: "what: a, b; and what: c" for
    each (what, items) that has items, items that hold commas themselves (shapes) joined by
    "; "; empty when no kind has any."""
    return "; and ".join(
        f"{what}: {('; ' if any(', ' in item for item in items) else ', ').join(items)}"
        for what, items in kinds
        if items
    )

"""The one exception type that zoo raises for bad input.

The CLI prints a `ZooError` as a single paragraph and exits non-zero, without a traceback: the
message itself must name the bad value and what would be valid.
"""


class ZooError(ValueError):
    """Bad input from the user: an unknown name, a wrong key or type, missing data."""


class NonFiniteLoss(ZooError):
    """The training loss became NaN or Inf under `trainer.nan_policy=stop`."""


class CorruptCheckpoint(ZooError):
    """A checkpoint whose arrays read back differently from how they were saved."""


class SaveFailed(ZooError):
    """A checkpoint could not be written (permission, full disk, I/O error)."""

"""`trainer.early_stop`: end a run once an eval metric has stopped improving.

After each eval the watched metric either improves on the best value so far by more than
`min_delta` (in the direction `mode` says) or counts as one more eval without improvement; after
`patience` of those in a row the run stops: it saves its final checkpoint, marked as stopped,
and a later run of the same command finds it complete. The counters travel in every
checkpoint's meta, so a killed and resumed run stops at the same eval as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass
class EarlyStop:
    metric: str
    mode: str  # "min" or "max"
    patience: int
    min_delta: float
    best: float | None = None
    best_step: int = 0
    waited: int = 0  # evals since the best one
    stopped: bool = False

    @classmethod
    def of(cls, config: Mapping[str, Any], saved: Mapping[str, Any]) -> EarlyStop | None:
        """The tracker `trainer.early_stop` asks for (None: off), continuing from the counters
        a checkpoint's meta saved."""
        if not config["metric"]:
            return None
        tracker = cls(config["metric"], config["mode"], config["patience"], config["min_delta"])
        for name in ("best", "best_step", "waited", "stopped"):
            if name in saved:
                setattr(tracker, name, saved[name])
        return tracker

    def update(self, step: int, metrics: Mapping[str, float]) -> str | None:
        """Count the eval at `step`; why the run stops there, or None to go on."""
        value = float(metrics[self.metric])
        sign = 1.0 if self.mode == "min" else -1.0
        if not math.isnan(value) and (
            self.best is None or sign * (self.best - value) > self.min_delta
        ):
            self.best, self.best_step, self.waited = value, step, 0
            return None
        self.waited += 1
        if self.waited < self.patience:
            return None
        self.stopped = True
        return (
            f"Stopping early at step {step}: val/{self.metric} has not improved by more than "
            f"{self.min_delta:g} for {self.patience} evals (best {self.best:.4g} at step "
            f"{self.best_step}; trainer.early_stop)."
        )

    def saved(self) -> dict[str, Any]:
        """The counters, for a checkpoint's meta."""
        return {
            "best": self.best,
            "best_step": self.best_step,
            "waited": self.waited,
            "stopped": self.stopped,
        }

"""What the loop does at its cadences besides stepping: close a log window every
`trainer.log_every` steps, evaluate every `trainer.eval_every`, checkpoint every
`trainer.checkpoint_every` (and on a stop request), each also after the last step.

Training metrics are summed on device over each log window and fetched a window late, so the
host never waits on the device to log; the open window's sums go into checkpoints, so a resumed
run logs exactly the numbers an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import grain
import jax
from zoo.engine.callbacks import Callbacks
from zoo.engine.checkpoints.manager import Checkpointer
from zoo.engine.checkpoints.start import Progress
from zoo.engine.early_stop import EarlyStop
from zoo.engine.errors import NonFiniteLoss
from zoo.engine.observe import WindowClock
from zoo.engine.report import Reporter
from zoo.engine.signals import Interrupted, StopRequests
from zoo.engine.steps import Metrics, health, means

log = logging.getLogger("zoo")
_timing_log = logging.getLogger("train.timing")  # train.log only, not the console


class LogWindows:
    """Training metrics, summed on device over each window of `log_every` steps.

    A closed window is fetched only when the next one closes (or an eval or a checkpoint needs
    it), by which time the device has long finished it."""

    def __init__(
        self,
        reporter: Reporter,
        schedule: Callable,
        checkpointer: Checkpointer | None,
        clock: WindowClock,
        report_extras: Callable[[int], None],
        window_start: int,
        skip_nonfinite: bool,
        callbacks: Callbacks | None = None,
    ):
        self._reporter = reporter
        self._checkpointer = checkpointer
        self._clock = clock
        self._report_extras = report_extras  # called with each reported window's last step
        self._learning_rate = jax.jit(schedule)  # one compilation, not one per eager op
        self._pending: tuple[int, int, Metrics, dict[str, Any]] | None = None
        self._skip = skip_nonfinite
        self.window_start = window_start  # the open window holds steps window_start+1 ...
        self._callbacks = callbacks or Callbacks()

    def close(self, step: int, sums: Metrics) -> None:
        # The learning rate is dispatched now and read with the window, a window later.
        speed = {**self._clock.lap(step), "learning_rate": self._learning_rate(step - 1)}
        window = (self.window_start, step, sums, speed)
        self.window_start = step
        self.report_pending()
        self._pending = window

    def report_pending(self) -> None:
        if self._pending is None:
            return
        start, step, sums, speed = self._pending
        self._pending = None
        self._check_health(start, step, sums)
        metrics = means(sums)
        metrics["learning_rate"] = float(speed.pop("learning_rate"))
        self._reporter.train_window(step, metrics, speed)
        self._report_extras(step)
        self._callbacks("on_train_window", step, metrics)

    def write_out(self) -> None:
        """Before a checkpoint: report the pending window and put every event so far on disk,
        so that the events up to a checkpoint's step are there as soon as the checkpoint is."""
        self.report_pending()
        self._reporter.flush()

    def check(self, sums: Metrics) -> None:
        """Before a checkpoint: stop if the open window met a NaN/Inf loss (nan_policy=stop)."""
        if not self._skip:
            self._check_health(self.window_start, None, sums)

    def _check_health(self, start: int, end: int | None, sums: Metrics) -> None:
        bad, first = health(sums)
        if not bad:
            return
        if self._skip:
            log.warning(
                "Skipped %d update(s) with a NaN or Inf train/loss in steps %d-%d, the first at "
                "step %d (trainer.nan_policy=skip).",
                bad,
                start + 1,
                end,
                start + first,
            )
            return
        self._pending = None
        raise NonFiniteLoss(
            f"train/loss became NaN or Inf at step {start + first} "
            f"(trainer.nan_policy=stop). {self._last_good()} Lower the learning rate, or resume "
            "with trainer.nan_policy=skip to drop such updates."
        )

    def _last_good(self) -> str:
        step = None if self._checkpointer is None else self._checkpointer.latest_step()
        if step is None:
            return "Stopped; no checkpoint had been saved."
        return (
            "Stopped without saving a later state: the last good checkpoint is step "
            f"{step} ({self._checkpointer.step_path(step)})."
        )


@dataclasses.dataclass(frozen=True)
class Every:
    """The loop's cadences, as plain ints: it reads them every step, and a config lookup costs
    microseconds."""

    total: int
    log: int
    eval: int
    checkpoint: int
    k: int  # steps per dispatch

    @classmethod
    def of(cls, trainer: Any) -> Every:
        return cls(
            int(trainer.steps),
            int(trainer.log_every),
            int(trainer.eval_every),
            int(trainer.checkpoint_every),
            int(trainer.steps_per_dispatch),
        )

    def closes_window(self, step: int) -> bool:
        return step % self.log == 0 or step == self.total

    def evaluates(self, step: int) -> bool:
        return bool(self.eval and step % self.eval == 0) or step == self.total

    def saves(self, step: int) -> bool:
        return bool(self.checkpoint and step % self.checkpoint == 0) or step == self.total


class Cadence:
    """The actions after each dispatch: `sums = cadence.after_dispatch(step, state, sums)`.
    `evaluate(step)` runs and reports an eval of the run's current state."""

    def __init__(
        self,
        every: Every,
        progress: Progress,
        windows: LogWindows,
        evaluate: Callable[[int], dict[str, float]],
        checkpointer: Checkpointer,
        iterator: grain.DatasetIterator,
        saved_config: Mapping[str, Any],
        meta: Callable[[], Mapping[str, Any]],
        zeros: Metrics,
        early_stop: EarlyStop | None = None,
        callbacks: Callbacks | None = None,
    ):
        self.every, self.progress, self.windows = every, progress, windows
        self._evaluate, self._checkpointer, self._iterator = evaluate, checkpointer, iterator
        self._config, self._meta, self._zeros = saved_config, meta, zeros
        self.stop = StopRequests()
        self.early_stop = early_stop
        self.callbacks = callbacks or Callbacks()
        self._unannounced: list[int] = []  # saved steps whose save may still be writing

    @property
    def finished(self) -> bool:
        """Whether the run has ended before trainer.steps (`trainer.early_stop`)."""
        return self.early_stop is not None and self.early_stop.stopped

    def after_dispatch(self, step: int, state: Any, sums: Metrics) -> Metrics:
        """Log, evaluate and checkpoint as due at `step`; the sums of the open window."""
        self._checkpointer.poll()  # a save failing in the background stops the run here
        if self.every.closes_window(step):
            self.windows.close(step, sums)
            sums = self._zeros
        if self.every.evaluates(step):
            self.windows.report_pending()
            metrics = self._evaluate(step)
            self.progress.eval_metrics, self.progress.eval_step = metrics, step
            if self.early_stop is not None and (why := self.early_stop.update(step, metrics)):
                log.info("%s", why)
                sums = self._close_last_window(step, sums)
            self.callbacks("on_eval", step, metrics)
        stop = self.stop.due(step // self.every.k)
        halting = self.callbacks.halting
        if self.every.saves(step) or stop is not None or self.finished or halting:
            self.save(step, state, sums)
        if stop is not None or halting:
            self.finish()
            path = self._checkpointer.step_path(step)
            raise Interrupted(stop, step, path) if stop else self.callbacks.halt(step, path)
        self.progress.step = step
        return sums

    def _close_last_window(self, step: int, sums: Metrics) -> Metrics:
        """An early stop between two log windows ends the run there: close and report the open
        window, as the last step of `trainer.steps` does (a SIGTERM instead saves it open, for
        the resumed run to go on with)."""
        if self.windows.window_start < step:
            self.windows.close(step, sums)
            self.windows.report_pending()
            sums = self._zeros
        return sums

    def save(self, step: int, state: Any, sums: Metrics) -> None:
        """Checkpoint `step`; never a state that a NaN/Inf loss has reached (nan_policy=stop)."""
        self.windows.write_out()
        self.windows.check(sums)
        progress = self.progress
        meta = {
            **self._meta(),
            "window_start": self.windows.window_start,
            "eval": {"step": progress.eval_step, "metrics": progress.eval_metrics},
        }
        if self.early_stop is not None:
            meta["early_stop"] = self.early_stop.saved()
        started = time.perf_counter()
        self._checkpointer.save(
            step,
            state,
            self._iterator,
            self._config,
            window=sums,
            meta=meta,
            metrics=progress.eval_metrics if progress.eval_step == step else None,
        )
        _timing_log.info("Checkpoint %d: %.3f s blocking", step, time.perf_counter() - started)
        # A save starts once the previous one is complete: announce those.
        self._announce(self._unannounced)
        self._unannounced = [step]

    def checkpoint_path(self, step: int) -> str:
        return self._checkpointer.step_path(step)

    def finish(self) -> None:
        """At the end of the run: wait for the last save and announce it to the callbacks."""
        self._checkpointer.wait()
        self._announce(self._unannounced)
        self._unannounced = []

    def _announce(self, steps: list[int]) -> None:
        for step in steps:
            self.callbacks("on_checkpoint", step, self._checkpointer.step_path(step))

"""What the loop does at its cadences besides stepping: close a log window every
`trainer.log_every` steps, evaluate every `trainer.eval_every`, checkpoint every
`trainer.checkpoint_every` (and on a stop request), each also after the last step.

`Every` says when each is due; `Cadence` holds the run's actions, one method each, that the
loop (`zoo.engine.loop.trainer.Trainer._train`) calls in order after each dispatch.

Training metrics are summed on device over each log window and fetched a window late, so the
host never waits on the device to log; the open window's sums go into checkpoints, so a resumed
run logs exactly the numbers an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import jax
from zoo.engine.checkpoints.manager import Checkpointer
from zoo.engine.checkpoints.start import Progress
from zoo.engine.errors import NonFiniteLoss
from zoo.engine.loop.callbacks import Callbacks
from zoo.engine.loop.early_stop import EarlyStop
from zoo.engine.loop.signals import Interrupted, StopRequests
from zoo.engine.report.observe import Instruments, WindowClock
from zoo.engine.report.reporter import Reporter
from zoo.engine.steps.functions import Metrics, health, means

if TYPE_CHECKING:
    import grain

log = logging.getLogger("zoo")
_timing_log = logging.getLogger("train.timing")  # train.log only, not the console


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
            total=int(trainer.steps),
            log=int(trainer.log_every),
            eval=int(trainer.eval_every),
            checkpoint=int(trainer.checkpoint_every),
            k=int(trainer.steps_per_dispatch),
        )

    def closes_window(self, step: int) -> bool:
        return step % self.log == 0 or step == self.total

    def evaluates(self, step: int) -> bool:
        return bool(self.eval and step % self.eval == 0) or step == self.total

    def saves(self, step: int) -> bool:
        return bool(self.checkpoint and step % self.checkpoint == 0) or step == self.total


@dataclasses.dataclass
class Window:
    """A closed log window: steps `start+1 .. end`, their sums still on the device, and the
    window's speed (its learning rate too, dispatched, read with the window)."""

    start: int
    end: int
    sums: Metrics
    speed: dict[str, Any]


class LogWindows:
    """Which log window is open, and the closed one waiting for its report: a closed window is
    fetched only when the next one closes (or an eval or a checkpoint needs it), by which time
    the device has long finished it."""

    def __init__(self, *, clock: WindowClock, schedule: Callable, start: int):
        self.clock = clock
        self.start = start  # the open window holds steps start+1 ...
        self._learning_rate = jax.jit(schedule)  # one compilation, not one per eager op
        self._pending: Window | None = None

    def close(self, step: int, sums: Metrics) -> Window | None:
        """Close the open window at `step`; the window closed before it, now due for its report."""
        # The learning rate is dispatched now and read with the window, a window later.
        speed = {**self.clock.lap(step), "learning_rate": self._learning_rate(step - 1)}
        window = Window(self.start, step, sums, speed)
        self.start = step
        previous, self._pending = self._pending, window
        return previous

    def take_pending(self) -> Window | None:
        window, self._pending = self._pending, None
        return window


@dataclasses.dataclass(kw_only=True)
class Cadence:
    """A run's cadences and the actions the loop takes at them, each a method named for what it
    does. The loop reads some of its parts too: batches from `iterator`, measurements around
    each dispatch from `instruments`, and whether to stop from `signals`, `callbacks` and
    `early_stop`."""

    every: Every
    progress: Progress  # where the run is: the loop advances it, the actions record evals
    iterator: grain.DatasetIterator  # each checkpoint saves its position
    windows: LogWindows
    instruments: Instruments
    reporter: Reporter
    evaluate_and_report: Callable[[int], dict[str, float]]  # an eval of the current state
    checkpointer: Checkpointer
    saved_config: Mapping[str, Any]  # the config as checkpoints record it
    meta: Mapping[str, Any]  # what every checkpoint's meta records of the run: seed, base key
    zeros: Metrics  # the sums of an empty window
    skip_nonfinite: bool  # trainer.nan_policy=skip
    early_stop: EarlyStop | None
    callbacks: Callbacks
    signals: StopRequests
    _unannounced: list[int] = dataclasses.field(default_factory=list, init=False)  # in flight

    @property
    def ended_early(self) -> bool:
        """Whether `trainer.early_stop` has ended the run before trainer.steps."""
        return self.early_stop is not None and self.early_stop.stopped

    def close_log_window(self, step: int, sums: Metrics) -> Metrics:
        """Close the log window at `step` and report the one closed before it (its metrics, the
        compilations and probes up to its end, `on_train_window`); the sums of the next."""
        previous = self.windows.close(step, sums)
        if previous is not None:
            self._report(previous)
        return self.zeros

    def evaluate(self, step: int) -> dict[str, float]:
        """Evaluate the current state (the pending window reported first, so the console reads
        in step order) and record it as the run's last eval."""
        self._report_pending_window()
        metrics = self.evaluate_and_report(step)
        self.progress.eval_metrics, self.progress.eval_step = metrics, step
        return metrics

    def stops_early(self, step: int, metrics: Mapping[str, float]) -> bool:
        """Count the eval at `step` for `trainer.early_stop`: whether the run ends here."""
        why = None if self.early_stop is None else self.early_stop.update(step, metrics)
        if why:
            log.info("%s", why)
        return why is not None

    def close_last_window(self, step: int, sums: Metrics) -> Metrics:
        """An early stop between two log windows ends the run there: close and report the open
        window, as the last step of `trainer.steps` does (a SIGTERM instead saves it open, for
        the resumed run to go on with)."""
        if self.windows.start < step:
            self.close_log_window(step, sums)
            self._report_pending_window()
            return self.zeros
        return sums

    def save_checkpoint(self, step: int, state: Any, sums: Metrics) -> None:
        """Checkpoint `step` (its events on disk first); never a state that a NaN/Inf loss has
        reached (nan_policy=stop). Each earlier save, complete by now, goes to `on_checkpoint`."""
        self._report_pending_window()
        self.reporter.flush()  # the events up to `step` are there as soon as the checkpoint is
        if not self.skip_nonfinite:
            self._check_health(self.windows.start, None, sums)
        progress = self.progress
        meta = {
            **self.meta,
            "compiles": self.instruments.compiles.totals(),
            "window_start": self.windows.start,
            "eval": {"step": progress.eval_step, "metrics": progress.eval_metrics},
        }
        if self.early_stop is not None:
            meta["early_stop"] = self.early_stop.saved()
        started = time.perf_counter()
        self.checkpointer.save(
            step,
            state,
            self.iterator,
            self.saved_config,
            window=sums,
            meta=meta,
            metrics=progress.eval_metrics if progress.eval_step == step else None,
        )
        _timing_log.info("Checkpoint %d: %.3f s blocking", step, time.perf_counter() - started)
        # A save starts once the previous one is complete: announce those.
        self._announce_saves()
        self._unannounced = [step]

    def halt(self, step: int, signal: int | None) -> Exception:
        """After the checkpoint of a stop request at `step` (a signal, else a callback's stop
        or failure): wait for it, and the exception that ends the run."""
        self._wait_for_saves()
        path = self.checkpointer.step_path(step)
        if signal is not None:
            return Interrupted(signal, step, path)
        return self.callbacks.halt(step, path)

    def finish(self) -> None:
        """After the last step: wait for the last save and announce it; a hook that failed
        after the last step's actions ends the run."""
        self._wait_for_saves()
        if self.callbacks.failure is not None:
            step = self.progress.step
            raise self.callbacks.halt(step, self.checkpointer.step_path(step))

    def _report_pending_window(self) -> None:
        window = self.windows.take_pending()
        if window is not None:
            self._report(window)

    def _report(self, window: Window) -> None:
        self._check_health(window.start, window.end, window.sums)
        metrics = means(window.sums)
        metrics["learning_rate"] = float(window.speed.pop("learning_rate"))
        self.reporter.train_window(window.end, metrics, window.speed)
        self.instruments.report(window.end, self.reporter)
        self.callbacks("on_train_window", window.end, metrics)

    def _check_health(self, start: int, end: int | None, sums: Metrics) -> None:
        bad, first = health(sums)
        if not bad:
            return
        if self.skip_nonfinite:
            log.warning(
                "Skipped %d update(s) with a NaN or Inf train/loss in steps %d-%d, the first at "
                "step %d (trainer.nan_policy=skip).",
                bad,
                start + 1,
                end,
                start + first,
            )
            return
        raise NonFiniteLoss(
            f"train/loss became NaN or Inf at step {start + first} "
            f"(trainer.nan_policy=stop). {self._last_good()} Lower the learning rate, or resume "
            "with trainer.nan_policy=skip to drop such updates."
        )

    def _last_good(self) -> str:
        step = self.checkpointer.latest_step()
        if step is None:
            return "Stopped; no checkpoint had been saved."
        return (
            "Stopped without saving a later state: the last good checkpoint is step "
            f"{step} ({self.checkpointer.step_path(step)})."
        )

    def _wait_for_saves(self) -> None:
        self.checkpointer.wait()
        self._announce_saves()

    def _announce_saves(self) -> None:
        steps, self._unannounced = self._unannounced, []
        for step in steps:
            self.callbacks("on_checkpoint", step, self.checkpointer.step_path(step))

"""Where a run's numbers go: TensorBoard event files under the workdir, and the console.

The console shows a live progress bar when it is a terminal and one plain line per log window
otherwise (CI logs, pipes), plus a one-line summary after each eval.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from tensorboardX import SummaryWriter

from zoo.console import CONSOLE

log = logging.getLogger("zoo")

# Seconds between flushes of the event file: short, so a running job shows up in TensorBoard.
FLUSH_SECS = 2


def format_metrics(metrics: Mapping[str, float]) -> str:
    return " ".join(f"{name} {value:.4g}" for name, value in metrics.items())


class Reporter:
    """Writes events and console lines; in a multi-process job only the primary process does."""

    def __init__(self, workdir: str, total_steps: int, start_step: int = 0, primary: bool = True):
        self._primary = primary
        # A run resumed from step s writes nothing at steps <= s. Events that an interrupted run
        # wrote after its last checkpoint (steps > s) are written again by the resumed run:
        # `purge_step` marks the new event file so that TensorBoard drops the old ones.
        self.writer = (
            SummaryWriter(
                logdir=os.path.abspath(workdir),
                flush_secs=FLUSH_SECS,
                purge_step=start_step + 1 if start_step else None,
            )
            if primary
            else None
        )
        self._total = total_steps
        self._progress: Progress | None = None
        if primary and CONSOLE.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
                console=CONSOLE,
                transient=True,
            )
            self._task = self._progress.add_task(
                "train", total=total_steps, completed=start_step, status=""
            )
            self._progress.start()

    def text(self, tag: str, markdown: str, step: int = 0) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, markdown, global_step=step)

    def scalars(self, prefix: str, step: int, values: Mapping[str, float]) -> None:
        if self.writer is None:
            return
        for name, value in values.items():
            self.writer.add_scalar(f"{prefix}/{name}", value, global_step=step)

    def train_window(
        self, step: int, metrics: Mapping[str, float], speed: Mapping[str, float]
    ) -> None:
        self.scalars("train", step, {**metrics, **speed})
        rate = f"{speed['steps_per_sec']:.0f} steps/s"
        if self._progress is not None:
            status = f"loss {metrics['loss']:.4g} | {rate}"
            self._progress.update(self._task, completed=step, status=status)
        elif self._primary:
            log.info("step %d/%d %s | %s", step, self._total, format_metrics(metrics), rate)

    def eval(self, step: int, metrics: Mapping[str, float]) -> None:
        self.scalars("eval", step, metrics)
        if self._primary:
            log.info("eval @ step %d: %s", step, format_metrics(metrics))

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self.writer is not None:
            self.writer.close()

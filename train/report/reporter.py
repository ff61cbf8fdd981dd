"""Where a run's numbers go: TensorBoard event files under the workdir, and the console.

The console shows a live progress bar when it is a terminal and one plain line per log window
otherwise (CI logs, pipes), plus a one-line summary after each eval.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from tensorboardX import SummaryWriter
from zoo.engine.report import event_files
from zoo.engine.report.console import CONSOLE

log = logging.getLogger("zoo")

# Seconds between flushes of the event file: short, so a running job shows up in TensorBoard.
FLUSH_SECS = 2
# The two tag groups TensorBoard opens first (its Time Series sorts groups by name and expands
# the first two): the loss and the model's metrics of each log window, then the evals. Every
# other group (`visuals`, `vitals`, `weights` for histograms, `xla`) sorts after them.
TRAIN, VAL = "train", "val"


def val_tag(metric: str) -> str:
    """The scalar tag of an eval metric (`val/accuracy`)."""
    return f"{VAL}/{metric}"


def format_metrics(metrics: Mapping[str, float]) -> str:
    return " ".join(f"{name} {value:.4g}" for name, value in metrics.items())


class Reporter:
    """Writes events and console lines; in a multi-process job only the primary process does."""

    def __init__(self, workdir: str, total_steps: int, start_step: int = 0, primary: bool = True):
        self.primary = primary
        if primary and start_step:  # the config this process announces is the one HParams shows
            event_files.drop_tag(workdir)
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

    def _events(self) -> SummaryWriter | None:
        """The event writer; None on a secondary process, or once its thread has died (a write
        failed, on a full disk): a later event would wait forever in its queue."""
        if self.writer is None:
            return None
        worker = self.writer.file_writer.event_writer._worker  # tensorboardX's writing thread
        if worker is None or worker.is_alive():
            return self.writer
        log.warning(
            "TensorBoard events can no longer be written into %s (see train.log for why); the "
            "run goes on without them.",
            self.writer.logdir,
        )
        _abandon(self.writer)
        self.writer = None
        return None

    def text(self, tag: str, markdown: str, step: int = 0) -> None:
        if (writer := self._events()) is not None:
            writer.add_text(tag, markdown, global_step=step)

    def image(self, tag: str, pixels: np.ndarray, step: int) -> None:
        """An H x W x C image of floats in [0, 1]."""
        if (writer := self._events()) is not None:
            writer.add_image(tag, pixels, step, dataformats="HWC")

    def histograms(self, step: int, summaries: Mapping[str, Mapping[str, Any]]) -> None:
        """Histograms computed elsewhere, by tag (see `zoo.engine.steps.histograms.summarize`)."""
        if (writer := self._events()) is None:
            return
        for tag, summary in summaries.items():
            values = {
                name: np.asarray(value).tolist() if name.startswith("bucket_") else float(value)
                for name, value in summary.items()
            }
            writer.add_histogram_raw(tag, global_step=step, **values)

    def summaries(self, summaries: Sequence[Any]) -> None:
        """Ready-made summary protos (the HParams plugin's), written as they are."""
        if (writer := self._events()) is not None:
            for summary in summaries:
                writer.file_writer.add_summary(summary)

    def scalars(self, prefix: str, step: int, values: Mapping[str, float]) -> None:
        if (writer := self._events()) is None:
            return
        for name, value in values.items():
            writer.add_scalar(f"{prefix}/{name}", value, global_step=step)

    def train_window(
        self, step: int, metrics: Mapping[str, float], speed: Mapping[str, float]
    ) -> None:
        model_metrics = {k: v for k, v in metrics.items() if k != "learning_rate"}
        self.scalars(TRAIN, step, model_metrics)  # the loss among the first cards
        self.scalars("vitals", step, {**speed, "learning_rate": metrics["learning_rate"]})
        rate = f"{speed['steps_per_sec']:.0f} steps/s"
        if self._progress is not None:
            status = f"loss {metrics['loss']:.4g} | {rate}"
            self._progress.update(self._task, completed=step, status=status)
        elif self.primary:
            log.info("step %d/%d %s | %s", step, self._total, format_metrics(metrics), rate)

    def eval(self, step: int, metrics: Mapping[str, float]) -> None:
        self.scalars(VAL, step, metrics)
        if self.primary:
            log.info("eval @ step %d: %s", step, format_metrics(metrics))

    def flush(self) -> None:
        """Write every event queued so far into the event file (the file's buffer included) and
        wait until it is there: called before each checkpoint, so that a run killed later has on
        disk every event up to the step it resumes from. (tensorboardX's own `flush` leaves the
        queue of its writing thread alone; that thread writes the file every `FLUSH_SECS`.)"""
        if (writer := self._events()) is None:
            return
        events = writer.file_writer.event_writer
        try:
            events._worker.stop()  # writes the queued events, up to its stop signal, and ends
            events._ev_writer.flush()
        except OSError as e:  # a full disk: the events so far are what is left
            log.warning("Could not write the TensorBoard events: %s", e)
            _abandon(writer)
            self.writer = None
            return
        events._worker = type(events._worker)(
            events._event_queue, events._ev_writer, events._flush_secs
        )
        events._worker.start()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._events() is not None:
            try:
                self.writer.close()
            except OSError as e:  # a full disk: the events so far are what is left
                log.warning("Could not finish writing the TensorBoard events: %s", e)
                _abandon(self.writer)


def _abandon(writer: SummaryWriter) -> None:
    """Give up on an event file that can no longer be written (a full disk): mark it closed, so
    that tensorboardX's own exit handler does not flush it again and print a traceback as the
    process ends. (tensorboardX leaves a writer whose flush failed open.)"""
    events = writer.file_writer.event_writer if writer.file_writer else None
    if events is None:
        return
    with contextlib.suppress(OSError):
        events._ev_writer.close()
    events._closed = True


@dataclasses.dataclass(frozen=True)
class ReplyPrompt:
    """A held-out prompt whose reply a chat model's eval hook writes: the prompt's token ids
    (the conversation before its last reply, rendered with the opening of the assistant's
    turn), the same as text, the reply the data holds, the ids that end a reply, and how many
    new tokens a reply may take at most."""

    ids: np.ndarray
    text: str
    reference: str
    end_of_turn: tuple[int, ...]
    max_new_tokens: int


@dataclasses.dataclass
class EvalReport:
    """What a model's `on_eval` hook gets besides the model: the step, a key of its own (from
    the seed and the step, so reruns draw the same samples), the first eval batch as the model
    sees it (host arrays, with the `mask` column), every eval batch on demand (`batches()`:
    device arrays sharded on the run's mesh, as the eval step gets them, for a hook that looks
    at the whole eval split), the data set's tokenizer (`Splits.tokenizer`; None: bytes), its
    class names if it has them, its held-out prompts to reply to (`prompts()`, from
    `Splits.prompts`; none for data that has no replies), and where to write what it makes."""

    step: int
    key: jax.Array
    examples: Mapping[str, np.ndarray]
    reporter: Reporter
    batches: Callable[[], Iterator[Mapping[str, jax.Array]]]
    tokenizer: Any = None
    class_names: Sequence[str] | None = None  # the data set's names of labels 0, 1, ...
    prompts: Callable[[], Sequence[ReplyPrompt]] = tuple

    def text(self, tag: str, markdown: str) -> None:
        """A TensorBoard text entry at this step."""
        self.reporter.text(tag, markdown, step=self.step)

    def image(self, tag: str, image: np.ndarray) -> None:
        """A TensorBoard image at this step: H x W x C (C = 1 or 3) floats in [0, 1]. Name it
        under `visuals/` (`visuals/samples`), as the built-in models do: TensorBoard opens the
        first two tag groups by name, and a group that sorts before `val` would push the eval
        curves off its first screen."""
        pixels = np.clip(np.asarray(image, np.float32), 0.0, 1.0)
        self.reporter.image(tag, pixels, self.step)

    def log(self, line: str) -> None:
        """A line on the console (and in train.log)."""
        if self.reporter.primary:
            log.info("%s", line)


def image_grid(images: np.ndarray, columns: int = 8, gap: int = 1) -> np.ndarray:
    """N x H x W x C images tiled row by row into one H' x W' x C image, `gap` pixels apart."""
    images = np.asarray(images)
    count, height, width, channels = images.shape
    rows = math.ceil(count / columns)
    grid = np.ones(
        (rows * (height + gap) - gap, columns * (width + gap) - gap, channels), images.dtype
    )
    for i, image in enumerate(images):
        top, left = (i // columns) * (height + gap), (i % columns) * (width + gap)
        grid[top : top + height, left : left + width] = image
    return grid

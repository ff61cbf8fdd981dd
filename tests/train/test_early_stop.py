"""`trainer.early_stop`: the run stops at the eval the rule picks out of an uninterrupted run's
eval history, saves that step, and a second run of the same command finds it complete; the open
log window of a stop between two windows is logged and delivered once; a run killed before its
stop and resumed stops at the same eval."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import pytest
from helpers import ROOT, read_events, run_cli, scalar_steps
from zoo.engine.checkpoints.reader import saved_steps
from zoo.engine.errors import ZooError

import zoo

STEPS, PATIENCE, MIN_DELTA = 200, 2, 0.01
RUN = (
    f"trainer.steps={STEPS}",
    "trainer.batch_size=64",
    "trainer.log_every=10",
    "trainer.eval_every=10",
    "trainer.steps_per_dispatch=10",
    "logging.norms_every=0",
)
ARGS = ("model=xor", *RUN)
EARLY = (
    "trainer.early_stop.metric=accuracy",
    "trainer.early_stop.mode=max",
    f"trainer.early_stop.patience={PATIENCE}",
    f"trainer.early_stop.min_delta={MIN_DELTA}",
)
# The eval loss falls by about 0.01 per eval at first: four evals in a row without a fall of
# more than LOSS_DELTA below the best stop the run early, after a few evals.
LOSS_PATIENCE, LOSS_DELTA = 4, 0.035
EARLY_LOSS = (
    "trainer.early_stop.metric=loss",
    "trainer.early_stop.mode=min",
    f"trainer.early_stop.patience={LOSS_PATIENCE}",
    f"trainer.early_stop.min_delta={LOSS_DELTA}",
)


def expected_stop(
    history: dict[int, float], patience=PATIENCE, min_delta=MIN_DELTA, rises=True
) -> int | None:
    """The first eval after which the metric has not improved (risen, or fallen) by more than
    min_delta beyond its best for `patience` evals in a row; None: it never stops."""
    best, waited = None, 0
    for step in sorted(history):
        gain = 0.0 if best is None else history[step] - best
        if best is None or (gain if rises else -gain) > min_delta:
            best, waited = history[step], 0
            continue
        waited += 1
        if waited == patience:
            return step
    return None


def loss_stop(history: dict[int, float]) -> int | None:
    return expected_stop(history, LOSS_PATIENCE, LOSS_DELTA, rises=False)


@pytest.fixture(scope="module")
def history(tmp_path_factory) -> dict[str, dict[int, float]]:
    """An uninterrupted run's eval metrics and 10-step training windows, by tag."""
    workdir = tmp_path_factory.mktemp("full")
    result = run_cli(*ARGS, f"workdir={workdir}")
    assert result.returncode == 0, result.stderr
    events = read_events(workdir)
    return {tag: scalar_steps(events, tag) for tag in ("val/accuracy", "val/loss", "train/loss")}


def test_stops_at_the_right_eval_saves_it_and_resumes_as_complete(history, tmp_path):
    stop = expected_stop(history["val/accuracy"])
    assert stop is not None and stop < STEPS
    first = run_cli(*ARGS, *EARLY, f"workdir={tmp_path}")
    assert first.returncode == 0, first.stderr
    assert f"Stopping early at step {stop}: val/accuracy has not improved" in first.stderr
    assert saved_steps(str(tmp_path / "checkpoints"))[-1] == stop
    assert max(scalar_steps(read_events(tmp_path), "train/loss")) == stop
    again = run_cli(*ARGS, *EARLY, f"workdir={tmp_path}")
    assert again.returncode == 0, again.stderr
    assert f"Already complete (stopped early at step {stop})" in again.stderr
    assert saved_steps(str(tmp_path / "checkpoints"))[-1] == stop


class Recorder:
    def __init__(self):
        self.windows: list[tuple[int, float]] = []
        self.evals: list[int] = []
        self.ends: list[int] = []

    def on_train_window(self, step, metrics):
        self.windows.append((step, metrics["loss"]))

    def on_eval(self, step, metrics):
        self.evals.append(step)

    def on_end(self, result):
        self.ends.append(result.step)


def test_a_falling_loss_stops_and_logs_its_last_partial_window_once(history, tmp_path):
    """mode=min on the loss with min_delta; windows of 30 steps, evals every 10: the stop falls
    inside a window, which the run closes there, as at its last step."""
    stop = loss_stop(history["val/loss"])
    assert stop is not None and stop % 30, f"the stop ({stop}) must fall inside a window"
    args = (*RUN, *EARLY_LOSS, "trainer.log_every=30", f"workdir={tmp_path}")
    recorder = Recorder()
    result = zoo.fit("xor", *args, callbacks=[recorder])
    assert result.step == stop and saved_steps(str(tmp_path / "checkpoints"))[-1] == stop
    windows = [*range(30, stop, 30), stop]
    logged = [(e.step, e.value) for e in read_events(tmp_path).Scalars("train/loss")]
    assert [step for step, _ in logged] == windows  # each once
    # The last window holds the steps after the last full one: the mean of the uninterrupted
    # run's 10-step windows over them.
    tens = [history["train/loss"][s] for s in range(windows[-2] + 10, stop + 1, 10)]
    assert logged[-1][1] == pytest.approx(sum(tens) / len(tens), rel=1e-5)
    assert [step for step, _ in recorder.windows] == windows
    assert [loss for _, loss in recorder.windows] == pytest.approx([v for _, v in logged], 1e-6)
    assert recorder.evals == list(range(10, stop + 1, 10)) and recorder.ends == [stop]
    complete = Recorder()  # the same call again: complete, nothing delivered twice
    assert zoo.fit("xor", *args, callbacks=[complete]).step == stop
    assert complete.windows == complete.evals == [] and complete.ends == [stop]


KILLED_AT_EVAL = """
import os, signal, sys
import zoo

class KillAt:
    def on_eval(self, step, metrics):  # a kill -9 of its own process, after this eval
        if step == int(sys.argv[1]):
            os.kill(os.getpid(), signal.SIGKILL)

zoo.fit("xor", *sys.argv[2:], callbacks=[KillAt()])
"""


def test_killed_before_the_stop_and_resumed_it_stops_at_the_same_eval(history, tmp_path):
    stop = loss_stop(history["val/loss"])
    assert stop is not None
    kill_at = stop - 10
    args = (*RUN, *EARLY_LOSS, "trainer.checkpoint_every=10", f"workdir={tmp_path}")
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_AT_EVAL, str(kill_at), *args],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = run_cli("model=xor", *args)
    assert resumed.returncode == 0, resumed.stderr
    start = int(re.search(r"Resuming at step (\d+)", resumed.stderr).group(1))
    assert 0 < start < kill_at
    # Counters that started afresh at the resume would stop elsewhere (or never).
    after = {s: v for s, v in history["val/loss"].items() if s > start}
    assert loss_stop(after) != stop
    assert f"Stopping early at step {stop}: val/loss has not improved" in resumed.stderr
    assert saved_steps(str(tmp_path / "checkpoints"))[-1] == stop


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.early_stop.patience=0", "patience=0 must be at least 1"),
        ("trainer.eval_every=0", "needs evals to watch"),
    ],
)
def test_bad_early_stop_settings_are_refused(override, message, tmp_path):
    with pytest.raises(ZooError, match=message):
        zoo.compose([*ARGS, *EARLY, override, f"workdir={tmp_path}"])


def test_an_unknown_metric_is_refused(tmp_path):
    cfg = zoo.compose([*ARGS, "trainer.early_stop.metric=nope", f"workdir={tmp_path}"])
    with pytest.raises(ZooError, match="early_stop.metric=nope is not an eval metric"):
        zoo.run(cfg)

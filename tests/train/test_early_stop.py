"""`trainer.early_stop`: the run stops at the eval the rule picks out of an uninterrupted run's
eval history, saves that step, and a second run of the same command finds it complete."""

from __future__ import annotations

import pytest
from helpers import read_events, run_cli, scalar_steps

import zoo
from train.errors import ZooError
from train.saved import saved_steps

STEPS, PATIENCE, MIN_DELTA = 200, 2, 0.01
ARGS = (
    "model=xor",
    f"trainer.steps={STEPS}",
    "trainer.batch_size=64",
    "trainer.log_every=10",
    "trainer.eval_every=10",
    "trainer.steps_per_dispatch=10",
    "logging.norms_every=0",
)
EARLY = (
    "trainer.early_stop.metric=accuracy",
    "trainer.early_stop.mode=max",
    f"trainer.early_stop.patience={PATIENCE}",
    f"trainer.early_stop.min_delta={MIN_DELTA}",
)


def expected_stop(history: dict[int, float]) -> int:
    """The first eval after which the accuracy has not risen by MIN_DELTA above its best for
    PATIENCE evals in a row."""
    best, waited = None, 0
    for step in sorted(history):
        if best is None or history[step] - best > MIN_DELTA:
            best, waited = history[step], 0
            continue
        waited += 1
        if waited == PATIENCE:
            return step
    raise AssertionError(f"the accuracy kept improving: {history}")


@pytest.fixture(scope="module")
def history(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("full")
    result = run_cli(*ARGS, f"workdir={workdir}")
    assert result.returncode == 0, result.stderr
    return scalar_steps(read_events(workdir), "val/accuracy")


def test_stops_at_the_right_eval_saves_it_and_resumes_as_complete(history, tmp_path):
    stop = expected_stop(history)
    assert stop < STEPS
    first = run_cli(*ARGS, *EARLY, f"workdir={tmp_path}")
    assert first.returncode == 0, first.stderr
    assert f"Stopping early at step {stop}: val/accuracy has not improved" in first.stderr
    assert saved_steps(str(tmp_path / "checkpoints"))[-1] == stop
    assert max(scalar_steps(read_events(tmp_path), "train/loss")) == stop
    again = run_cli(*ARGS, *EARLY, f"workdir={tmp_path}")
    assert again.returncode == 0, again.stderr
    assert f"Already complete (stopped early at step {stop})" in again.stderr
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

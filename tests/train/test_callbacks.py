"""Callbacks of `zoo.fit`: every window, eval and checkpoint once, with the values the logs
hold; a stop request saves and resumes; a failing callback stops with its traceback; across a
kill -9 and a resume every window reaches the callback exactly once, with the values an
uninterrupted run gives it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import jax
import pytest
from helpers import ROOT, read_events, scalar_steps
from zoo.engine.checkpoints.reader import saved_steps

import zoo

ARGS = (
    "data=digits",
    "model.hidden_sizes=[16]",
    "trainer.batch_size=16",
    "trainer.steps=40",
    "trainer.log_every=5",
    "trainer.eval_every=10",
    "trainer.checkpoint_every=20",
    "optimizer.warmup_steps=0",
    "logging.norms_every=0",
)


class Recorder:
    def __init__(self, stop_at_eval: int | None = None, fail_at_window: int | None = None):
        self.calls: list[tuple] = []
        self.stop_at_eval, self.fail_at_window = stop_at_eval, fail_at_window
        self.meshes: set[str] = set()  # the mesh current in each hook: none, as outside the run

    def on_train_window(self, step, metrics):
        self.meshes.add(str(jax.sharding.get_abstract_mesh()))
        self.calls.append(("window", step, metrics["loss"]))
        if step == self.fail_at_window:
            raise ValueError("callback bug")

    def on_eval(self, step, metrics):
        self.meshes.add(str(jax.sharding.get_abstract_mesh()))
        self.calls.append(("eval", step, metrics["loss"]))
        return zoo.STOP if step == self.stop_at_eval else None

    def on_checkpoint(self, step, path):
        self.meshes.add(str(jax.sharding.get_abstract_mesh()))
        self.calls.append(("checkpoint", step, path))

    def on_end(self, result):
        self.calls.append(("end", result.step, None))


def steps(recorder: Recorder, kind: str) -> list[int]:
    return [step for what, step, _ in recorder.calls if what == kind]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("callbacks")
    recorder = Recorder()
    zoo.fit("mlp", *ARGS, f"workdir={workdir}", callbacks=[recorder])
    return recorder, workdir


def test_every_window_eval_and_checkpoint_once_with_the_logged_values(finished):
    recorder, workdir = finished
    events = read_events(workdir)
    assert steps(recorder, "window") == list(range(5, 41, 5))
    assert steps(recorder, "eval") == [10, 20, 30, 40]
    assert steps(recorder, "checkpoint") == [20, 40]
    assert recorder.calls[-1][:2] == ("end", 40)
    losses = scalar_steps(events, "train/loss")
    for what, step, loss in recorder.calls:
        if what == "window":
            assert loss == pytest.approx(losses[step], rel=1e-6)
    saved = [path for what, _, path in recorder.calls if what == "checkpoint"]
    assert saved == [str(workdir / "checkpoints" / s) for s in ("20", "40")]
    assert (
        recorder.meshes
        == {str(jax.sharding.get_abstract_mesh())}
        == {"AbstractMesh((), axis_types=())"}
    )


def test_a_stop_request_saves_and_the_run_resumes(tmp_path):
    stopping = Recorder(stop_at_eval=30)
    with pytest.raises(zoo.CallbackStop, match="Recorder.on_eval after step 30"):
        zoo.fit("mlp", *ARGS, f"workdir={tmp_path}", callbacks=[stopping])
    assert saved_steps(str(tmp_path / "checkpoints"))[-1] == 30
    assert steps(stopping, "end") == []  # a call that ends in an exception has no on_end
    again = Recorder()
    result = zoo.fit("mlp", *ARGS, f"workdir={tmp_path}", callbacks=[again])
    assert result.start_step == 30 and steps(again, "window") == [35, 40]
    assert again.calls[-1][:2] == ("end", 40)
    complete = Recorder()  # a call that finds the run complete trains nothing and ends
    zoo.fit("mlp", *ARGS, f"workdir={tmp_path}", callbacks=[complete])
    assert [call[:2] for call in complete.calls] == [("end", 40)]


def test_a_failing_callback_stops_where_it_failed_and_the_run_resumes_there(tmp_path):
    # Window 25 reaches the callbacks as window 30 closes, at step 30: neither a checkpoint of
    # the cadence (20, 40) nor the last step, so only the stop saves there.
    failing = Recorder(fail_at_window=25)
    with pytest.raises(zoo.CallbackFailed, match="Recorder.on_train_window raised ValueError") as e:
        zoo.fit("mlp", *ARGS, f"workdir={tmp_path}", callbacks=[failing])
    assert isinstance(e.value.__cause__, ValueError)
    assert e.value.__cause__.__traceback__.tb_frame is not None
    assert e.value.step == 30
    assert e.value.checkpoint == str(tmp_path / "checkpoints" / "30")
    assert saved_steps(str(tmp_path / "checkpoints")) == [20, 30]
    assert max(scalar_steps(read_events(tmp_path), "train/loss")) == 30  # nothing trained after
    assert steps(failing, "window")[-1] == 25 and steps(failing, "end") == []
    again = Recorder(fail_at_window=25)
    result = zoo.fit("mlp", *ARGS, f"workdir={tmp_path}", callbacks=[again])
    assert result.start_step == 30 and steps(again, "window") == [35, 40]


SCRIPT = """
import json, os, signal, sys
import zoo

class Append:
    def on_train_window(self, step, metrics):
        with open(sys.argv[1], "a") as f:
            f.write(json.dumps([step, metrics["loss"]]) + "\\n")

    def on_checkpoint(self, step, path):  # a kill -9 of its own process, between two windows
        if step == int(sys.argv[2]):
            os.kill(os.getpid(), signal.SIGKILL)

zoo.fit("mlp", *sys.argv[3:], callbacks=[Append()])
"""


def fit_in_process(seen, workdir, kill_at_checkpoint=-1):
    args = (*ARGS, "trainer.checkpoint_every=10", f"workdir={workdir}")
    return subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(seen), str(kill_at_checkpoint), *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_across_a_kill_and_a_resume_every_window_reaches_the_callback_once(finished, tmp_path):
    recorder, _ = finished
    seen = tmp_path / "seen.jsonl"
    # Checkpoint 20 is announced once complete, as the save at 30 starts: killed there, the
    # run has delivered windows 25 and 30, which the resume from 20 replays.
    killed = fit_in_process(seen, tmp_path / "run", kill_at_checkpoint=20)
    killed.communicate(timeout=300)
    assert killed.returncode == -signal.SIGKILL
    before_kill = [json.loads(line)[0] for line in seen.read_text().splitlines()]
    assert before_kill == [5, 10, 15, 20, 25, 30]
    resumed = fit_in_process(seen, tmp_path / "run")
    _, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr
    assert "Resuming at step 20" in stderr
    windows = [tuple(json.loads(line)) for line in seen.read_text().splitlines()]
    expected = {step: loss for what, step, loss in recorder.calls if what == "window"}
    assert [step for step, _ in windows] == sorted(expected)  # each once, in order
    for step, loss in windows:
        assert loss == pytest.approx(expected[step], rel=1e-6)

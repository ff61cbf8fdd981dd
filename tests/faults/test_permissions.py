"""Directories the run may not write, as a user meets them: each stops the run within seconds
with one line naming the path and the cause, exit status 2, and nothing changed.

The suite runs as root, whom mode bits do not stop: these runs drop every capability first, so
that the mode bits apply to them as to any user."""

from __future__ import annotations

import re

import pytest
from fault_tools import MLP, kept, run

import zoo

ARGS = (*MLP, "trainer.checkpoint_every=100", "trainer.keep=2")


def error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr, stderr
    return lines[0]


def test_a_checkpoint_directory_the_run_cannot_write_stops_it_before_training(tmp_path):
    (tmp_path / "checkpoints").mkdir(mode=0o555)
    status, stderr, seconds = run(
        *ARGS, "trainer.steps=200", f"workdir={tmp_path}", unprivileged=True
    )
    assert status == 2 and seconds < 60
    line = error_line(stderr)
    assert f"Cannot write checkpoints into {tmp_path}/checkpoints: Permission denied" in line
    assert "Nothing was trained" in line
    assert (
        not list(tmp_path.glob("events.out.tfevents.*")) and not (tmp_path / "train.log").exists()
    )


def test_an_old_checkpoint_that_cannot_be_removed_stops_the_run_with_every_checkpoint_intact(
    tmp_path,
):
    status, stderr, _ = run(*ARGS, "trainer.steps=200", f"workdir={tmp_path}")
    assert status == 0, stderr
    (tmp_path / "checkpoints" / "100" / "state").chmod(0o555)  # its files cannot be deleted
    before = kept(tmp_path)
    status, stderr, seconds = run(
        *ARGS, "trainer.steps=300", f"workdir={tmp_path}", unprivileged=True
    )
    (tmp_path / "checkpoints" / "100" / "state").chmod(0o755)
    assert status == 2 and seconds < 60
    line = error_line(stderr)
    assert "Checkpoint 300 was saved, but removing an older checkpoint from" in line
    assert "Permission denied" in line and "step 300 among them, are intact" in line
    after = kept(tmp_path)
    latest = {k: v for k, v in before.items() if "/checkpoints/200/" in k}
    assert latest and {k: after.get(k) for k in latest} == latest
    assert zoo.load(tmp_path).step == 300


@pytest.mark.parametrize(
    ("workdir", "message"),
    [
        ("file", r"is a file, not a directory"),
        ("/proc/zoo-run", r"Cannot use workdir=/proc/zoo-run: "),
        ("/sys/zoo-run", r"Cannot use workdir=/sys/zoo-run: "),
        ("locked/run", r"Cannot use workdir=.*locked/run: Permission denied"),
    ],
)
def test_a_workdir_that_cannot_be_written_is_refused_before_anything_runs(
    workdir, message, tmp_path
):
    (tmp_path / "file").write_text("not a directory")
    (tmp_path / "locked").mkdir(mode=0o555)
    path = workdir if workdir.startswith("/") else str(tmp_path / workdir)
    status, stderr, seconds = run(*ARGS, "trainer.steps=100", f"workdir={path}", unprivileged=True)
    assert status == 2 and seconds < 60
    assert re.search(message, error_line(stderr)), stderr
    assert (tmp_path / "file").read_text() == "not a directory"
    assert not any((tmp_path / "locked").iterdir())

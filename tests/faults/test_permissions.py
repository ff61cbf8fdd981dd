"""Directories the run may not write, as a user meets them: each stops the run within seconds
with one line naming the path and the cause, exit status 2, and nothing changed.

The suite runs as root, whom mode bits do not stop: these runs drop every capability first, so
that the mode bits apply to them as to any user. The workdirs an earlier run left are copies of
one real run's."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
from fault_tools import MLP, WITHOUT_CAPABILITIES, kept, run
from helpers import ROOT

import zoo

ARGS = (*MLP, "trainer.checkpoint_every=100", "trainer.keep=2")


def error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr, stderr
    return lines[0]


# What an earlier run leaves in its workdir, each made unwritable in turn (0o555 for a
# directory, 0o444 for a file): the run must find out before it writes anything, rather than at
# its first event file (a traceback) or its first log line (a log silently lost).
UNWRITABLE = (".", ".hydra", "checkpoints", ".zoo.lock", "train.log")


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory):
    """A run's workdir with checkpoints 100 and 200, for each test to copy."""
    workdir = tmp_path_factory.mktemp("earlier") / "run"
    status, stderr, _ = run(*ARGS, "trainer.steps=200", f"workdir={workdir}")
    assert status == 0, stderr
    return workdir


def unwritable_copy(earlier_run, destination, part: str):
    shutil.copytree(earlier_run, destination)
    path = destination / part
    path.chmod(0o555 if path.is_dir() else 0o444)
    return path


def every_file(workdir) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(workdir.rglob("*")) if p.is_file()}


def test_an_old_checkpoint_that_cannot_be_removed_stops_the_run_with_every_checkpoint_intact(
    earlier_run, tmp_path
):
    workdir = tmp_path / "run"
    shutil.copytree(earlier_run, workdir)
    (workdir / "checkpoints" / "100" / "state").chmod(0o555)  # its files cannot be deleted
    before = kept(workdir)
    status, stderr, seconds = run(
        *ARGS, "trainer.steps=300", f"workdir={workdir}", unprivileged=True
    )
    (workdir / "checkpoints" / "100" / "state").chmod(0o755)
    assert status == 2 and seconds < 60
    line = error_line(stderr)
    assert "Checkpoint 300 was saved, but removing an older checkpoint from" in line
    assert "Permission denied" in line and "step 300 among them, are intact" in line
    after = kept(workdir)
    latest = {k: v for k, v in before.items() if "/checkpoints/200/" in k}
    assert latest and {k: after.get(k) for k in latest} == latest
    assert zoo.load(workdir).step == 300


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


def test_a_sweep_refuses_each_workdir_it_could_not_write_all_of_before_any_job_runs(
    earlier_run, tmp_path
):
    paths = [unwritable_copy(earlier_run, tmp_path / str(i), p) for i, p in enumerate(UNWRITABLE)]
    before = every_file(tmp_path)
    seeds = ",".join(str(i) for i in range(len(UNWRITABLE)))
    status, stderr, seconds = run(
        "-m", *ARGS, "trainer.steps=200", f"workdir={tmp_path}", f"seed={seeds}", unprivileged=True
    )
    assert status == 2 and seconds < 60 and "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == len(UNWRITABLE), stderr
    for i, (line, path) in enumerate(zip(lines, paths, strict=True)):
        assert line.startswith(f"error: job {i} (")
        assert f"Cannot use workdir={tmp_path / str(i)}: Permission denied ({path})" in line
        assert "Nothing was written" in line
    assert every_file(tmp_path) == before


def test_zoo_fit_refuses_a_workdir_it_cannot_write_before_writing_anything(earlier_run, tmp_path):
    workdir = tmp_path / "run"
    unwritable_copy(earlier_run, workdir, ".")
    before = every_file(workdir)
    script = textwrap.dedent(f"""
        import zoo
        try:
            zoo.fit("mlp", *{list(ARGS[1:])!r}, "trainer.steps=200", "workdir={workdir}")
        except zoo.ZooError as e:
            print(e)
    """)
    result = subprocess.run(
        [*WITHOUT_CAPABILITIES, sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, "JAX_NUM_CPU_DEVICES": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"Cannot use workdir={workdir}: Permission denied ({workdir})")
    assert every_file(workdir) == before

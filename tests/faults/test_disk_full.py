"""A full disk: the save that cannot be written stops the run within seconds with one line
naming the cause and the last good checkpoint, exit status 2, nothing lost; with space again the
same command resumes and ends with the bits of an uninterrupted run.

The workdir lies on a small tmpfs mounted for the test where the platform allows mounting (root
here); elsewhere the save is made to fail with ENOSPC at the checkpoint library's call
(`full_disk_plugin`)."""

from __future__ import annotations

import os
import subprocess

import pytest
from fault_tools import MLP, assert_same_arrays, final_arrays, kept, run
from helpers import ROOT, overriding
from zoo.engine.report import event_files

# Checkpoints of about 1 MB: the room left on the full disk holds the run's log lines, not them.
ARGS = overriding(
    *MLP,
    "model.hidden_sizes=[256,256]",
    "optimizer.schedule=constant",
    "trainer.checkpoint_every=100",
    "trainer.keep=10",
)
ROOM = 256 * 1024  # bytes left free when the disk is filled
SIMULATED = {"ZOO_PLUGINS": "full_disk_plugin", "PYTHONPATH": str(ROOT / "tests" / "faults")}


def events_but_hparams(path) -> list[bytes]:
    """The event records of `path`, less the HParams entry that a resumed run replaces."""
    payloads = event_files.records(path.read_bytes())
    return [p for p in payloads if not event_files.holds_tag(p, event_files.SESSION_START_TAG)]


@pytest.fixture
def disk(tmp_path):
    """(a directory on a 64 MiB file system of its own, how to fill it up, how to empty it);
    without mounting, filling sets a variable that the plugin reads."""
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)],
            capture_output=True,
            check=False,
        ).returncode
        == 0
    )
    filler, env = mount / "filler", {}

    def fill() -> None:
        if mounted:
            free = os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize
            with open(filler, "wb") as f:
                os.posix_fallocate(f.fileno(), 0, free - ROOM)
        else:
            env.update(SIMULATED)

    def empty() -> None:
        filler.unlink(missing_ok=True)
        env.clear()

    yield mount, fill, empty, env
    if mounted:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_stops_the_run_at_once_and_the_same_command_resumes(disk, tmp_path):
    mount, fill, empty, env = disk
    workdir = mount / "run"
    status, stderr, _ = run(*ARGS, "trainer.steps=100", f"workdir={workdir}")
    assert status == 0, stderr
    before = kept(workdir)
    (first_events,) = workdir.glob("events.out.tfevents.*")
    first = events_but_hparams(first_events)

    fill()
    status, stderr, seconds = run(*ARGS, "trainer.steps=400", f"workdir={workdir}", env=env)
    assert status == 2, stderr
    assert seconds < 60
    message = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(message) == 1, stderr
    assert "Saving checkpoint 200 into" in message[0] and "No space left on device" in message[0]
    assert f"the last complete checkpoint is step 100 ({workdir}/checkpoints/100)" in message[0]
    assert "Traceback" not in stderr and "Exception ignored" not in stderr
    after = kept(workdir)  # every checkpoint as it was
    saved = {k: v for k, v in before.items() if "/checkpoints/" in k}
    assert saved and {k: after.get(k) for k in saved} == saved
    assert events_but_hparams(first_events) == first  # and every event of the first run

    empty()
    status, stderr, _ = run(*ARGS, "trainer.steps=400", f"workdir={workdir}")
    assert status == 0, stderr
    reference = tmp_path / "reference"
    status, stderr, _ = run(*ARGS, "trainer.steps=400", f"workdir={reference}")
    assert status == 0, stderr
    assert_same_arrays(final_arrays(workdir, 400), final_arrays(reference, 400))

"""kill -9 of a run whose batches are made by two Grain workers: its workers die with it, and
the same command run again ends with the bits of a run made without workers, and exits cleanly
(no shared memory of its workers left behind)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from fault_tools import assert_same_arrays, final_arrays, logged_step, run, start, wait_for
from image_files import RUN_ARGS as ARGS
from image_files import RUN_STEPS as STEPS


def children(pid: int) -> set[int]:
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found |= {int(c) for c in (task / "children").read_text().split()}
        except FileNotFoundError:  # a thread that ended while we looked
            continue
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_killed_with_two_workers_resumes_with_the_bits_of_a_run_without_workers(
    image_folder, tmp_path
):
    # The run without workers that the killed one must match, alongside it (both start slowly).
    inline = start(*ARGS, f"data.path={image_folder}", f"workdir={tmp_path / 'inline'}")
    workdir = tmp_path / "killed"
    args = (*ARGS, f"data.path={image_folder}", "data.workers=2", f"workdir={workdir}")
    process = start(*args)
    wait_for(logged_step(workdir, 12, STEPS), process)
    workers = children(process.pid)
    assert len(workers) >= 2  # the two workers (and multiprocessing's resource tracker)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in workers)  # no worker outlives the training process
    status, stderr, _ = run(*args)
    assert status == 0, stderr
    assert "leaked shared_memory" not in stderr  # the workers freed what they held, and exited
    assert "Resuming at step" in (workdir / "train.log").read_text()
    _, stderr = inline.communicate(timeout=300)
    assert inline.returncode == 0, stderr
    assert_same_arrays(final_arrays(workdir, STEPS), final_arrays(tmp_path / "inline", STEPS))

"""Two runs on one workdir: the second stops at once, naming the first by pid and host, and
changes nothing; reading the workdir meanwhile is allowed; the lock dies with its process, so
after a `kill -9` the same command runs again at once."""

from __future__ import annotations

import signal
import socket

from fault_tools import MLP, kept, logged_step, run, start, wait_for

import zoo

ARGS = (*MLP, "trainer.checkpoint_every=100")


def test_a_second_run_on_a_workdir_in_use_stops_at_once_and_changes_nothing(tmp_path):
    first = start(*ARGS, "trainer.steps=100000", f"workdir={tmp_path}")
    try:
        wait_for(logged_step(tmp_path, 200, 100000), first)
        first.send_signal(signal.SIGSTOP)  # hold its files still while the second one tries
        before = kept(tmp_path)
        status, stderr, seconds = run(*ARGS, "trainer.steps=100000", f"workdir={tmp_path}")
        assert status == 2 and seconds < 60
        message = stderr.strip()
        assert message.startswith("error: ") and "\n" not in message, stderr
        assert (
            f"is in use by another run (pid {first.pid} on host {socket.gethostname()}" in message
        )
        assert kept(tmp_path) == before
        assert zoo.load(tmp_path).step >= 100  # reading a workdir in use is allowed
        first.send_signal(signal.SIGKILL)  # stopped still: no later checkpoint
        first.communicate()
        status, stderr, _ = run(*ARGS, "trainer.steps=300", f"workdir={tmp_path}")
        assert status == 0, stderr  # no stale lock after kill -9
    finally:
        first.kill()
        first.communicate()

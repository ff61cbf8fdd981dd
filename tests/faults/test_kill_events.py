"""kill -9 right after a checkpoint: the TensorBoard events up to that checkpoint's step are
already on disk (the event writer is flushed at each checkpoint, whatever its own flush timer),
so the resumed run's curves have every step once, with no gap before the restored step."""

from __future__ import annotations

import re
import signal

from fault_tools import MLP, run, start, wait_for
from helpers import ROOT, read_events

STEPS, LOG, EVERY = 48, 4, 16
ARGS = (*MLP, f"trainer.steps={STEPS}", f"trainer.checkpoint_every={EVERY}")
# Only the run's own flushes put events on disk before the kill: not the writer's timer, nor a
# full file buffer.
SLOW_FLUSH = {"ZOO_PLUGINS": "slow_flush_plugin", "PYTHONPATH": str(ROOT / "tests" / "faults")}


def steps(workdir, tag: str) -> list[int]:
    """The steps of `tag` as TensorBoard reads them, in file order, repeats included."""
    return [event.step for event in read_events(workdir).Scalars(tag)]


def test_events_up_to_the_restored_step_survive_a_kill(tmp_path):
    process = start(*ARGS, f"workdir={tmp_path}", env=SLOW_FLUSH)
    wait_for((tmp_path / "checkpoints" / str(EVERY)).is_dir, process)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL
    before = steps(tmp_path, "train/loss")
    status, stderr, _ = run(*ARGS, f"workdir={tmp_path}", env=SLOW_FLUSH)
    assert status == 0, stderr
    restored = int(re.search(r"Resuming at step (\d+)", stderr).group(1))
    assert restored >= EVERY
    assert [s for s in before if s <= restored] == list(range(LOG, restored + 1, LOG))
    assert steps(tmp_path, "train/loss") == list(range(LOG, STEPS + 1, LOG))

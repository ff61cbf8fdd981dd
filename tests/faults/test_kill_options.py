"""kill -9 with bf16, gradient accumulation, an EMA of the weights and K steps per dispatch all
on: the same command run again ends with the bits and logged numbers of an uninterrupted run."""

from __future__ import annotations

import signal

import pytest
from fault_tools import MLP, assert_same_arrays, final_arrays, logged_step, run, start, wait_for
from helpers import read_events, scalar_steps

STEPS = 64
ARGS = (
    *MLP,
    f"trainer.steps={STEPS}",
    "trainer.checkpoint_every=8",
    "trainer.eval_every=16",
    "trainer.steps_per_dispatch=2",
    "trainer.precision=bf16",
    "trainer.grad_accum_steps=4",
    "optimizer.ema_decay=0.9",
)
TAGS = ("train/loss", "val/loss", "val_ema/loss")


def logged(workdir) -> dict[str, dict[int, float]]:
    events = read_events(workdir)
    return {tag: scalar_steps(events, tag) for tag in TAGS}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    status, stderr, _ = run(*ARGS, f"workdir={workdir}")
    assert status == 0, stderr
    return final_arrays(workdir, STEPS), logged(workdir)


def test_killed_and_run_again_ends_with_the_same_bits(uninterrupted, tmp_path):
    final, numbers = uninterrupted
    process = start(*ARGS, f"workdir={tmp_path}")
    wait_for(logged_step(tmp_path, 28, STEPS), process)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL
    status, stderr, _ = run(*ARGS, f"workdir={tmp_path}")
    assert status == 0, stderr
    assert "Resuming at step" in stderr
    assert_same_arrays(final_arrays(tmp_path, STEPS), final)
    assert logged(tmp_path) == numbers
    assert len(numbers["val_ema/loss"]) == 4

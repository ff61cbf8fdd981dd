"""kill -9 at seeded random moments, some of them in the middle of a checkpoint save: the same
command run again ends with the bits and the logged losses of an uninterrupted run."""

from __future__ import annotations

import random
import signal

import pytest
from fault_tools import MLP, assert_same_arrays, final_arrays, logged_step, run, start, wait_for
from helpers import read_events, scalar_steps

STEPS, EVERY = 240, 24
ARGS = (*MLP, f"trainer.steps={STEPS}", f"trainer.checkpoint_every={EVERY}", "trainer.keep=20")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    status, stderr, _ = run(*ARGS, f"workdir={workdir}")
    assert status == 0, stderr
    return final_arrays(workdir, STEPS), scalar_steps(read_events(workdir), "train/loss")


def saving(workdir):
    """True while a save is being written: Orbax's temporary directory exists."""
    checkpoints = workdir / "checkpoints"
    return lambda: (
        checkpoints.is_dir()
        and any(".orbax-checkpoint-tmp" in name.name for name in checkpoints.iterdir())
    )


def kill_moment(seed: int) -> int | None:
    """A seeded moment: None for during a save, else the step once logged."""
    rng = random.Random(seed)
    return None if rng.random() < 0.5 else 4 * rng.randrange(2, STEPS // 4 - 2)


@pytest.mark.parametrize("seed", range(4))
def test_killed_at_a_random_moment_and_run_again_ends_with_the_same_bits(
    uninterrupted, seed, tmp_path
):
    final, losses = uninterrupted
    step = kill_moment(seed)
    when = "during a save" if step is None else f"after step {step}"
    condition = saving(tmp_path) if step is None else logged_step(tmp_path, step, STEPS)
    process = start(*ARGS, f"workdir={tmp_path}")
    wait_for(condition, process)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL, when
    status, stderr, _ = run(*ARGS, f"workdir={tmp_path}")
    assert status == 0, f"{when}: {stderr}"
    assert_same_arrays(final_arrays(tmp_path, STEPS), final)
    resumed = scalar_steps(read_events(tmp_path), "train/loss")
    assert resumed.keys() == losses.keys(), when
    assert all(resumed[step] == losses[step] for step in losses), when


def test_the_seeds_kill_during_saves_and_between_them():
    moments = [kill_moment(seed) for seed in range(4)]
    assert None in moments and any(m is not None for m in moments), moments

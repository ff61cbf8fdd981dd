"""A fine-tune of a pretrained GPT-2 checkpoint (the tiny fixture, with its tokenizer, on a text
file) killed with SIGKILL mid-run and run again ends with the bits and the logged losses of an
uninterrupted fine-tune."""

from __future__ import annotations

import signal

import pytest
from fault_tools import assert_same_arrays, final_arrays, logged_step, run, start, wait_for
from helpers import ROOT, read_events, scalar_steps

FIXTURES = ROOT / "tests" / "fixtures" / "pretrained"
STEPS, KILL_AFTER = 40, 20
ARGS = (
    f"finetune.init_from={FIXTURES / 'gpt2-tiny'}",
    f"data.path={FIXTURES / 'tiny.txt'}",
    "data.window=16",
    "trainer.batch_size=8",  # 35 batches an epoch: the run crosses an epoch boundary
    f"trainer.steps={STEPS}",
    "trainer.log_every=5",
    "trainer.checkpoint_every=10",
    f"trainer.eval_every={STEPS}",
    "optimizer.warmup_steps=0",
    "logging.norms_every=0",
)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    status, stderr, _ = run(*ARGS, f"workdir={workdir}")
    assert status == 0, stderr
    assert "Starting from the gpt2 checkpoint" in (workdir / "train.log").read_text()
    return final_arrays(workdir, STEPS), scalar_steps(read_events(workdir), "train/loss")


def test_a_killed_fine_tune_run_again_ends_with_the_same_bits(uninterrupted, tmp_path):
    final, losses = uninterrupted
    process = start(*ARGS, f"workdir={tmp_path}")
    wait_for(logged_step(tmp_path, KILL_AFTER, STEPS), process)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL
    saved = [int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()]
    assert max(saved) < STEPS  # killed mid-run: the second run resumes
    status, stderr, _ = run(*ARGS, f"workdir={tmp_path}")
    assert status == 0, stderr
    assert_same_arrays(final_arrays(tmp_path, STEPS), final)
    resumed = scalar_steps(read_events(tmp_path), "train/loss")
    assert resumed.keys() == losses.keys()
    assert all(resumed[step] == losses[step] for step in losses)

"""A fine-tune of a pretrained checkpoint (a tiny fixture, with its tokenizer, on a text file)
killed with SIGKILL mid-run and run again ends with the bits and the logged losses of an
uninterrupted fine-tune: GPT-2 with every param trained, and Qwen 3 with LoRA adapters on its
attention and MLP projections, over its own kernels or over their nf4 codes (QLoRA) (the
adapters, their optimizer state, the codes and the data position are what the resume must
restore)."""

from __future__ import annotations

import signal

import pytest
from fault_tools import assert_same_arrays, final_arrays, logged_step, run, start, wait_for
from helpers import ROOT, read_events, scalar_steps

FIXTURES = ROOT / "tests" / "fixtures" / "pretrained"
STEPS, KILL_AFTER = 80, 20
COMMON = (
    f"data.path={FIXTURES / 'tiny.txt'}",
    "data.window=16",
    "trainer.batch_size=8",  # 35 batches an epoch: the run crosses epoch boundaries
    f"trainer.steps={STEPS}",
    "trainer.log_every=5",
    "trainer.checkpoint_every=10",
    f"trainer.eval_every={STEPS}",
    "optimizer.warmup_steps=0",
    "logging.norms_every=0",
)
STARTS = {
    "gpt2": (f"finetune.init_from={FIXTURES / 'gpt2-tiny'}",),
    "qwen3-lora": (
        f"finetune.init_from={FIXTURES / 'qwen3-tiny'}",
        "finetune.lora_rank=4",
        "finetune.lora_layers=layers",
    ),
    "qwen3-qlora": (
        f"finetune.init_from={FIXTURES / 'qwen3-tiny'}",
        "finetune.lora_rank=4",
        "finetune.lora_layers=layers",
        "finetune.quantize=nf4",
    ),
}


@pytest.fixture(scope="module", params=sorted(STARTS))
def case(request, tmp_path_factory):
    """(the run's arguments, the final arrays and logged losses of it run uninterrupted)."""
    args = (*STARTS[request.param], *COMMON)
    workdir = tmp_path_factory.mktemp("uninterrupted")
    status, stderr, _ = run(*args, f"workdir={workdir}")
    assert status == 0, stderr
    family = request.param.split("-")[0]
    assert f"Starting from the {family} checkpoint" in (workdir / "train.log").read_text()
    losses = scalar_steps(read_events(workdir), "train/loss")
    return args, final_arrays(workdir, STEPS), losses


def saved(workdir) -> list[int]:
    """The steps of the finished checkpoints (a save in progress has a temporary name)."""
    checkpoints = workdir / "checkpoints"
    return (
        [int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()]
        if checkpoints.is_dir()
        else []
    )


def test_a_killed_fine_tune_run_again_ends_with_the_same_bits(case, tmp_path):
    args, final, losses = case
    process = start(*args, f"workdir={tmp_path}")
    logged = logged_step(tmp_path, KILL_AFTER, STEPS)
    wait_for(lambda: logged() and bool(saved(tmp_path)), process)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL
    resumed_from = max(saved(tmp_path))
    assert 0 < resumed_from < STEPS  # killed mid-run: the second run resumes
    status, stderr, _ = run(*args, f"workdir={tmp_path}")
    assert status == 0, stderr
    assert_same_arrays(final_arrays(tmp_path, STEPS), final)
    # Every loss logged after the checkpoint it resumed from, as the uninterrupted run logged
    # it (events of the killed run's last two seconds may be lost: they are flushed every 2 s).
    resumed = scalar_steps(read_events(tmp_path), "train/loss")
    after = [step for step in losses if step > resumed_from]
    assert after and all(resumed[step] == losses[step] for step in after)
    assert all(resumed[step] == losses[step] for step in resumed)

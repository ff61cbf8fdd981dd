"""A fine-tune of a pretrained checkpoint (a tiny fixture, with its tokenizer, on a text file)
killed with SIGKILL mid-run and run again ends with the bits and the logged losses of an
uninterrupted fine-tune: GPT-2 with every param trained, and Qwen 3 with LoRA adapters on its
attention and MLP projections over its own kernels, and Qwen 3 with adapters over the nf4 codes of
its kernels (QLoRA) on conversations packed several to a row (`data.packing`) (the adapters,
their optimizer state, the codes and the data position are what the resume must restore), and
Qwen 2.5 with adapters trained on preference pairs packed several to an example
(`finetune.method=dpo`, its reference the model with the adapters off), and Qwen 2.5 with adapters over nf4 codes trained on the rewards
of completions it samples (`finetune.method=grpo`). The packed run logs its packing efficiency to TensorBoard."""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest
from fault_tools import assert_same_arrays, final_arrays, logged_step, run, start, wait_for
from helpers import ROOT, read_events, scalar_steps

FIXTURES = ROOT / "tests" / "fixtures" / "pretrained"
STEPS = 40
"""Steps of a run (killed after half of them); a post-training run's steps cost more and are
fewer (`SHORT_STEPS`), its data crossing into the next epoch all the same."""
SHORT_STEPS = 16
TEXT = (f"data.path={FIXTURES / 'tiny.txt'}", "data.window=16")
COMMON = (
    "trainer.batch_size=8",  # 35 batches an epoch of text: the resumed run crosses into the next
    "optimizer.warmup_steps=0",
    "logging.norms_every=0",
    "logging.eval_reports=false",  # the final eval's sampled text: not what is compared
)


def lengths(steps: int) -> tuple[str, ...]:
    """A run of `steps` steps, logged 8 times, with 4 checkpoints and an eval at the end."""
    return (
        f"trainer.steps={steps}",
        f"trainer.log_every={steps // 8}",
        f"trainer.checkpoint_every={steps // 4}",
        f"trainer.eval_every={steps}",
    )


STARTS = {
    "gpt2": (f"finetune.init_from={FIXTURES / 'gpt2-tiny'}",),
    "qwen3-lora": (
        f"finetune.init_from={FIXTURES / 'qwen3-tiny'}",
        "finetune.lora_rank=4",
        "finetune.lora_layers=layers",
    ),
    "qwen3-qlora-packed": (
        f"finetune.init_from={FIXTURES / 'qwen3-chat'}",
        "finetune.lora_rank=4",
        "finetune.lora_layers=layers",
        "finetune.quantize=nf4",
        "data=chat",
        "data.packing=true",
        "data.buckets=[64]",  # rows of 64 targets, about 3 conversations each
    ),
}
PACKED, DPO, GRPO = "qwen3-qlora-packed", "qwen2-dpo-lora-packed", "qwen2-grpo-qlora"
STARTS[DPO] = (
    f"finetune.init_from={FIXTURES / 'qwen25-chat'}",
    "finetune.lora_rank=4",
    "finetune.method=dpo",
    "data=preference",
    "data.packing=true",
    "data.buckets=[256]",  # rows of 256 targets, 1 to 3 pairs each (pairs of 85 tokens a side)
)
STARTS[GRPO] = (
    f"finetune.init_from={FIXTURES / 'qwen25-chat'}",
    "finetune.lora_rank=4",
    "finetune.quantize=nf4",
    "finetune.method=grpo",
    "finetune.grpo.rewards=[tests.fixtures.posttraining.toy_rewards:vowels]",
    "finetune.grpo.num_generations=4",
    "finetune.grpo.max_completion_length=4",
    "data=prompts",
    "data.eval_replies=0",
)


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    """60 conversations of skewed lengths, packed into a few batches an epoch."""
    words = np.minimum(np.random.default_rng(0).pareto(1.5, 60) * 4, 30).astype(int)
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    rows = [
        [{"role": "user", "content": f"q{i}" + " w" * n}, {"role": "assistant", "content": f"a{i}"}]
        for i, n in enumerate(words)
    ]
    path.write_text("".join(json.dumps({"messages": row}) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """60 preference pairs: a prompt, and a reply preferred to the same reply reversed."""
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    rows = [
        {"prompt": f"q{i}", "chosen": f"a{i} b{i}", "rejected": f"b{i} a{i}"} for i in range(60)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """60 prompts, whose completions are rewarded for their vowels (each step samples them
    with the policy the step before left, from a key of its step)."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Say {i}."}) + "\n" for i in range(60)))
    return path


@pytest.fixture(scope="module", params=sorted(STARTS))
def case(request, tmp_path_factory, conversations, pairs, prompts):
    """(the run's arguments and steps, the final arrays and logged losses of it run
    uninterrupted, its workdir)."""
    files = {PACKED: conversations, DPO: pairs, GRPO: prompts}
    data = (f"data.path={files[request.param]}",) if request.param in files else TEXT
    steps = SHORT_STEPS if request.param in (DPO, GRPO) else STEPS
    args = (*STARTS[request.param], *data, *COMMON, *lengths(steps))
    workdir = tmp_path_factory.mktemp("uninterrupted")
    status, stderr, _ = run(*args, f"workdir={workdir}")
    assert status == 0, stderr
    family = request.param.split("-")[0]
    assert f"Starting from the {family} checkpoint" in (workdir / "train.log").read_text()
    losses = scalar_steps(read_events(workdir), "train/loss")
    return args, steps, final_arrays(workdir, steps), losses, workdir


def saved(workdir) -> list[int]:
    """The steps of the finished checkpoints (a save in progress has a temporary name)."""
    checkpoints = workdir / "checkpoints"
    return (
        [int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()]
        if checkpoints.is_dir()
        else []
    )


def test_a_killed_fine_tune_run_again_ends_with_the_same_bits(case, tmp_path):
    args, steps, final, losses, _ = case
    process = start(*args, f"workdir={tmp_path}")
    logged = logged_step(tmp_path, steps // 2, steps)
    wait_for(lambda: logged() and bool(saved(tmp_path)), process)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL
    resumed_from = max(saved(tmp_path))
    assert 0 < resumed_from < steps  # killed mid-run: the second run resumes
    status, stderr, _ = run(*args, f"workdir={tmp_path}")
    assert status == 0, stderr
    assert_same_arrays(final_arrays(tmp_path, steps), final)
    # Every loss logged after the checkpoint it resumed from, as the uninterrupted run logged
    # it (events of the killed run's last two seconds may be lost: they are flushed every 2 s).
    resumed = scalar_steps(read_events(tmp_path), "train/loss")
    after = [step for step in losses if step > resumed_from]
    assert after and all(resumed[step] == losses[step] for step in after)
    assert all(resumed[step] == losses[step] for step in resumed)


@pytest.mark.parametrize("case", [PACKED], indirect=True)
def test_a_packed_fine_tune_logs_its_packing_efficiency(case):
    efficiency = scalar_steps(read_events(case[-1]), "train/packing_efficiency")
    assert sorted(efficiency) == list(range(5, STEPS + 1, 5))
    assert all(0.8 < share <= 1 for share in efficiency.values())

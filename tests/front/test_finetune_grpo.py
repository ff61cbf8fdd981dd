"""Reward fine-tuning (`finetune.method=grpo`) of a tiny chat checkpoint (Qwen 2.5's, its real
chat template) on prompts read by `data=prompts`: each step samples a group of completions per
prompt with the policy the step before left, scores them with reward functions (a Python
callable, or `module:function` from the command line), and trains on their group-normalised
advantages. A verifier the policy can satisfy (the share of vowels it writes) raises the
held-out mean reward from its start to a stated threshold; TensorBoard gets the rewards, the
completions' lengths, entropy and clip fractions, and a table of sampled completions at each
eval. A reward function that raises is named with the prompt's row, and the run stops with its
checkpoints intact, or goes on as `finetune.grpo.on_error=skip` says."""

from __future__ import annotations

import json

import pytest
from helpers import ROOT, read_events, run_cli, scalar_steps

import zoo
from zoo.plugin import ZooError

CHECKPOINT = ROOT / "tests" / "fixtures" / "pretrained" / "qwen25-chat"
REWARDS = "tests.fixtures.posttraining.toy_rewards"
START, THRESHOLD = 0.2, 0.4
"""The first step's mean reward is below START (random replies: about 0.13); 30 steps must
raise the held-out mean reward to THRESHOLD."""
SAMPLING = (
    "trainer.batch_size=8",  # prompts; 8 completions each
    "finetune.grpo.num_generations=8",
    "finetune.grpo.max_completion_length=4",
    "data.eval_fraction=0.2",
    "data.eval_replies=0",
    "logging.norms_every=0",
)


def vowels(prompts, completions, **columns):
    return [sum(c in "aeiouAEIOU" for c in text) / max(len(text), 1) for text in completions]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    rows = [{"prompt": f"Write a word ({i}).", "answer": str(i)} for i in range(40)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def learned(tmp_path_factory, prompt_file):
    """30 steps of GRPO, every param trained, rewarded by `vowels` given from Python."""
    workdir = tmp_path_factory.mktemp("grpo") / "run"
    return zoo.finetune(
        CHECKPOINT,
        *SAMPLING,
        "trainer.steps=30",
        "trainer.log_every=1",
        "trainer.eval_every=15",
        "optimizer.learning_rate=1e-2",
        f"workdir={workdir}",
        data=prompt_file,
        method="grpo",
        rewards=[vowels],
    )


def test_grpo_raises_the_held_out_reward(learned):
    first = scalar_steps(read_events(learned.workdir), "train/reward")[1]
    assert first < START, first
    assert learned.eval_metrics["reward"] >= THRESHOLD, learned.eval_metrics
    assert learned.config.finetune.grpo.rewards == ["python:test_finetune_grpo.vowels"]


def test_zoo_evaluate_refuses_a_reward_run_by_name(learned, prompt_file):
    with pytest.raises(ZooError, match="finetune.method=grpo") as refused:
        zoo.evaluate(learned, "prompts")
    assert "val/reward" in str(refused.value)


def test_tensorboard_shows_what_reward_runs_watch(learned):
    events = read_events(learned.workdir)
    tags = set(events.Tags()["scalars"])
    watched = (
        "reward",
        "reward_std",
        "rewards/vowels/mean",
        "rewards/vowels/std",
        "advantages/std",
        "entropy",
        "clip_ratio/region",
        "completions/mean_length",
        "completions/min_length",
        "completions/max_length",
        "completions/clipped_ratio",
    )
    for name in watched:
        assert f"train/{name}" in tags and f"val/{name}" in tags, name
    assert "completions/text_summary" in events.Tags()["tensors"]
    table = events.Tensors("completions/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert "| prompt | completion | vowels |" in table and "Write a word" in table


def test_num_iterations_trains_on_each_batch_of_completions_twice(prompt_file, tmp_path):
    """Steps 1 and 2 train on the completions sampled at step 1 (the ratio of step 2 to the
    policy that sampled them), steps 3 and 4 on those sampled at step 3."""
    workdir = tmp_path / "run"
    run_with_vowels(
        workdir,
        prompt_file,
        "trainer.steps=4",
        "trainer.checkpoint_every=2",
        "finetune.grpo.num_iterations=2",
    )
    events = read_events(workdir)
    rewards = scalar_steps(events, "train/reward")
    lengths = scalar_steps(events, "train/completions/mean_length")
    assert rewards[1] == rewards[2] != rewards[3] == rewards[4]
    assert lengths[1] == lengths[2] and lengths[3] == lengths[4]
    # With a ratio of 1 the loss is the completions' advantages, weighted by their tokens, the
    # same for the same batch: step 2's differs as its ratio is to the policy that sampled it.
    losses = scalar_steps(events, "train/loss")
    assert losses[2] != losses[1]


def run_with_vowels(workdir, prompt_file, *overrides, **kwargs) -> None:
    """A short run rewarded by `vowels`, every step logged, at a learning rate that moves."""
    zoo.finetune(
        CHECKPOINT,
        *SAMPLING,
        "trainer.log_every=1",
        "optimizer.learning_rate=1e-2",
        *overrides,
        f"workdir={workdir}",
        data=prompt_file,
        method="grpo",
        rewards=[vowels],
        **kwargs,
    )


def kl_run(workdir, prompt_file, *overrides, **kwargs):
    """Three steps penalising the KL to the starting model (beta 0.5); the KL of each step."""
    beta = ("trainer.steps=3", "trainer.eval_every=0", "finetune.grpo.beta=0.5")
    run_with_vowels(workdir, prompt_file, *beta, *overrides, **kwargs)
    events = read_events(workdir)
    return {name: scalar_steps(events, f"train/{name}") for name in ("kl", "loss")}


def test_a_frozen_copy_is_the_kl_reference_of_a_full_fine_tune(prompt_file, tmp_path):
    """Every param trained: the KL to the frozen copy is 0 at the first step (the policy is
    the starting model), and then the policy's distance from it."""
    kl = kl_run(tmp_path / "run", prompt_file, "finetune.grpo.reference=copy")["kl"]
    assert kl[1] == pytest.approx(0.0, abs=1e-6)
    assert kl[2] > 0.01 and kl[3] > 0.01, kl


def test_a_frozen_copy_and_the_adapters_off_are_the_same_reference(prompt_file, tmp_path):
    """With LoRA the starting model is the base with its adapters off (they start at zero):
    the frozen copy gives the KL, and so the loss, that the adapters-off reference gives."""
    runs = {
        reference: kl_run(
            tmp_path / reference, prompt_file, f"finetune.grpo.reference={reference}", lora_rank=4
        )
        for reference in ("adapters", "copy")
    }
    for name in ("kl", "loss"):
        adapters, copy = runs["adapters"][name], runs["copy"][name]
        assert adapters.keys() == copy.keys() == {1, 2, 3}
        for step in adapters:
            assert copy[step] == pytest.approx(adapters[step], rel=1e-5, abs=1e-7), (name, step)
    assert runs["copy"]["kl"][3] > 0


def test_a_reward_function_that_raises_stops_the_run_naming_it(prompt_file, tmp_path):
    workdir = tmp_path / "run"
    done = run_cli(
        f"finetune.init_from={CHECKPOINT}",
        "finetune.method=grpo",
        f"finetune.grpo.rewards=[{REWARDS}:vowels,{REWARDS}:fails_at_step_4]",
        "data=prompts",
        f"data.path={prompt_file}",
        *SAMPLING,
        "trainer.steps=8",
        "trainer.checkpoint_every=1",
        "trainer.eval_every=0",
        f"workdir={workdir}",
    )
    assert done.returncode != 0
    error = done.stderr.rpartition("error: ")[2]
    assert "Reward function 'fails_at_step_4' raised ValueError: no verdict today" in error
    assert "toy_rewards.py:" in error and "prompts.jsonl:" in error, error
    kept = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert kept == [1, 2, 3]  # the steps before the failure, readable
    assert zoo.load(workdir).step == 3


def test_a_bad_reward_is_skipped_when_asked(prompt_file, tmp_path):
    workdir = tmp_path / "run"
    done = zoo.finetune(
        CHECKPOINT,
        *SAMPLING,
        "trainer.steps=2",
        "trainer.eval_every=2",
        f"finetune.grpo.rewards=[{REWARDS}:vowels,{REWARDS}:one_short]",
        "finetune.grpo.on_error=skip",
        f"workdir={workdir}",
        data=prompt_file,
        method="grpo",
    )
    assert done.step == 2
    log = (workdir / "train.log").read_text()
    assert "one_short" in log and "returned 63 values for 64 completions" in log, log


@pytest.mark.parametrize(
    ("overrides", "kwargs", "named"),
    [
        ((), {}, ["finetune.grpo.rewards", "exact_match"]),
        (("finetune.grpo.rewards=[exactly]",), {}, ["exactly", "numeric_match"]),
        (
            ("finetune.grpo.rewards=[exact_match]", "finetune.grpo.beta=0.1"),
            {},
            ["finetune.grpo.beta=0.1", "finetune.lora_rank", "finetune.grpo.reference=copy"],
        ),
        (
            (
                "finetune.grpo.rewards=[exact_match]",
                "finetune.grpo.beta=0.1",
                "finetune.grpo.reference=precomputed",
            ),
            {},
            ["finetune.grpo.reference=precomputed", "adapters", "copy"],
        ),
        (
            ("finetune.grpo.rewards=[exact_match]", "finetune.grpo.reference=copy"),
            {},
            ["finetune.grpo.reference=copy", "beta=0"],
        ),
        (
            ("finetune.grpo.rewards=[exact_match]", "finetune.dpo.loss_type=ipo"),
            {},
            ["finetune.dpo.loss_type=ipo applies only to method=dpo", "is method=grpo"],
        ),
        (
            ("finetune.grpo.rewards=[exact_match]", "trainer.steps_per_dispatch=2"),
            {},
            ["trainer.steps_per_dispatch=2"],
        ),
        (
            (
                "finetune.grpo.rewards=[exact_match]",
                "finetune.grpo.num_iterations=3",
                "trainer.checkpoint_every=4",
            ),
            {},
            ["trainer.checkpoint_every", "num_iterations=3"],
        ),
        (("finetune.grpo.temperature=0",), {}, ["finetune.grpo.temperature=0"]),
        (
            ("finetune.grpo.rewards=[exact_match]", "data.buckets=[128,512]"),
            {},
            ["data.buckets=[128, 512]", "sequences of 515 tokens", "at most 509"],
        ),
    ],
    ids=[
        "no-rewards",
        "unknown-reward",
        "kl-without-adapters",
        "precomputed-reference",
        "reference-without-kl",
        "dpo-key",
        "dispatch",
        "iterations",
        "greedy",
        "no-room-for-completions",
    ],
)
def test_bad_settings_are_refused_before_anything_is_written(
    prompt_file, tmp_path, overrides, kwargs, named
):
    workdir = tmp_path / "run"
    with pytest.raises(ZooError) as refused:
        zoo.finetune(
            CHECKPOINT,
            *SAMPLING,
            "trainer.steps=2",
            *overrides,
            f"workdir={workdir}",
            data=prompt_file,
            method="grpo",
            **kwargs,
        )
    for text in named:
        assert text in str(refused.value), str(refused.value)
    assert not workdir.exists()


def test_conversations_are_refused_by_grpo(tmp_path):
    chat = tmp_path / "chat.jsonl"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    chat.write_text("".join(json.dumps({"messages": turns}) + "\n" for _ in range(10)))
    with pytest.raises(ZooError, match="samples completions of prompts"):
        zoo.finetune(
            CHECKPOINT,
            *SAMPLING[:1],
            "trainer.steps=2",
            "data=chat",
            f"data.path={chat}",
            "finetune.grpo.rewards=[exact_match]",
            f"workdir={tmp_path / 'run'}",
            method="grpo",
        )

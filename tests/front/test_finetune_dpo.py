"""Preference fine-tuning (`finetune.method=dpo`) of a tiny chat checkpoint (Qwen 2.5's, its
real chat template) on pairs read by `data=preference`: the chosen reply of every pair is the
rejected one in capitals, so a policy that learns to prefer capitals ranks held-out pairs it
never saw. With LoRA the reference is the starting model with its adapters off, so the first
step's policy is the reference bit for bit (a loss of exactly log 2); with every param trained
it is the starting model's log-probabilities computed once before training. A mesh computes
the steps one device does; a bad combination of method, data and reference is refused by name
before anything is written."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from helpers import ROOT, TWO_LOGGED_STEPS, read_events, run_cli, scalar_steps

import zoo
from zoo.plugin import ZooError

CHECKPOINT = ROOT / "tests" / "fixtures" / "pretrained" / "qwen25-chat"
WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "maple",
    "ember",
    "frost",
    "lilac",
    "quartz",
    "tiger",
    "ocean",
    "amber",
    "willow",
    "comet",
]
LEARNING = (
    "trainer.steps=30",
    "trainer.batch_size=8",
    "trainer.log_every=1",
    "trainer.eval_every=30",
    "optimizer.learning_rate=1e-2",
    "data.eval_fraction=0.25",
    "data.eval_replies=1",
    "data.eval_reply_tokens=4",
    "logging.norms_every=0",
)
SHORT = TWO_LOGGED_STEPS
ACCURACY = 0.9
"""Held-out preference accuracy that the learning run must reach (it starts at 0: the policy is
the reference, every reward 0)."""


def pairs(count: int) -> list[dict[str, str]]:
    """Prompts asking to repeat two words; the chosen reply shouts them."""
    rng = np.random.default_rng(0)
    rows = []
    for index in range(count):
        words = " ".join(rng.choice(WORDS, 2, replace=False))
        prompt = f"Repeat after me ({index}): {words}"
        rows.append({"prompt": prompt, "chosen": words.upper(), "rejected": words})
    return rows


@pytest.fixture(scope="module")
def pair_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in pairs(64)))
    return path


@pytest.fixture(scope="module")
def learned(tmp_path_factory, pair_file):
    """30 steps of DPO with LoRA adapters on the capitals task."""
    workdir = tmp_path_factory.mktemp("dpo") / "run"
    return zoo.finetune(
        CHECKPOINT, *LEARNING, f"workdir={workdir}", data=pair_file, method="dpo", lora_rank=8
    )


def test_dpo_raises_held_out_preference_accuracy(learned):
    assert learned.eval_metrics["rewards/accuracies"] >= ACCURACY, learned.eval_metrics
    assert learned.eval_metrics["rewards/margins"] > 0
    assert learned.config.finetune.method == "dpo"


def test_the_reference_is_the_starting_model_with_adapters_off(learned):
    events = read_events(learned.workdir)
    first = {
        name: scalar_steps(events, f"train/{name}")[1]
        for name in ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies")
    }
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert first["rewards/chosen"] == first["rewards/rejected"] == 0.0
    assert first["rewards/accuracies"] == 0.0
    losses = scalar_steps(events, "train/loss")
    assert losses[30] < 0.2 < losses[1]


def test_tensorboard_shows_what_preference_runs_watch(learned):
    events = read_events(learned.workdir)
    tags = set(events.Tags()["scalars"])
    watched = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
    for name in (*watched, "logps/chosen", "logps/rejected"):
        assert f"train/{name}" in tags and f"val/{name}" in tags, name
    assert any(tag.startswith("replies/") for tag in events.Tags()["tensors"])


def test_packed_pairs_learn_from_the_same_reference(pair_file, tmp_path):
    """`data.packing=true`: several pairs to an example, each pair's loss its own (a first
    loss of exactly log 2 with LoRA: every pair at the reference), and the held-out pairs
    (one to an example) ranked as the unpacked run ranks them."""
    done = zoo.finetune(
        CHECKPOINT,
        *LEARNING,
        "data.packing=true",
        "data.buckets=[256]",
        f"workdir={tmp_path / 'run'}",
        data=pair_file,
        method="dpo",
        lora_rank=8,
    )
    events = read_events(done.workdir)
    assert scalar_steps(events, "train/loss")[1] == pytest.approx(math.log(2), abs=1e-7)
    assert scalar_steps(events, "train/packing_efficiency")[1] > 0.7
    assert done.eval_metrics["rewards/accuracies"] >= ACCURACY, done.eval_metrics


def test_a_precomputed_reference_scores_each_packed_pair(pair_file, tmp_path):
    """A full fine-tune's reference computed once over packed examples: a value per pair, so
    that IPO starts at its value at the reference, ((0 - 0) - 1 / (2 beta))^2 = 25."""
    done = zoo.finetune(
        CHECKPOINT,
        *SHORT,
        "data.packing=true",
        "data.buckets=[256]",
        "finetune.dpo.reference=precomputed",
        "finetune.dpo.loss_type=ipo",
        f"workdir={tmp_path / 'run'}",
        data=pair_file,
        method="dpo",
    )
    losses = scalar_steps(read_events(done.workdir), "train/loss")
    assert losses[1] == pytest.approx(25.0, rel=1e-5) and losses[2] < losses[1]


@pytest.mark.parametrize("reference", ["precomputed", "copy"])
def test_a_full_fine_tune_from_the_command_line_has_a_reference(pair_file, tmp_path, reference):
    workdir = tmp_path / "run"
    done = run_cli(
        f"finetune.init_from={CHECKPOINT}",
        "finetune.method=dpo",
        f"finetune.dpo.reference={reference}",
        "finetune.dpo.loss_type=ipo",
        "data=preference",
        f"data.path={pair_file}",
        *SHORT,
        f"workdir={workdir}",
    )
    assert done.returncode == 0, done.stderr
    events = read_events(workdir)
    # IPO at the reference: ((0 - 0) - 1 / (2 beta))^2 with beta 0.1
    first = scalar_steps(events, "train/loss")[1]
    assert first == pytest.approx(25.0, rel=1e-5)
    assert abs(scalar_steps(events, "train/rewards/margins")[1]) < 1e-5


@pytest.mark.parametrize("loss_type", ["simpo", "orpo"])
def test_reference_free_losses_train_every_param(pair_file, tmp_path, loss_type):
    done = zoo.finetune(
        CHECKPOINT,
        *SHORT,
        f"finetune.dpo.loss_type={loss_type}",
        f"workdir={tmp_path / 'run'}",
        data=pair_file,
        method="dpo",
    )
    assert np.isfinite(done.eval_metrics["loss"])
    assert "log_odds_ratio" in done.eval_metrics or loss_type == "simpo"


def test_a_mesh_computes_the_steps_one_device_does(pair_file, tmp_path):
    one, mesh = tmp_path / "one", tmp_path / "mesh"
    adapters = ("finetune.lora_rank=4", "finetune.method=dpo")
    data = ("data=preference", f"data.path={pair_file}")
    done = run_cli(
        f"finetune.init_from={CHECKPOINT}",
        *adapters,
        *data,
        *SHORT,
        "mesh.cpu_devices=1",
        f"workdir={one}",
    )
    assert done.returncode == 0, done.stderr
    zoo.finetune(
        CHECKPOINT, *SHORT, *MESH, f"workdir={mesh}", data=pair_file, method="dpo", lora_rank=4
    )
    losses = {run: scalar_steps(read_events(run), "train/loss") for run in (one, mesh)}
    assert losses[one].keys() == losses[mesh].keys() == {1, 2}
    for step in (1, 2):
        assert losses[mesh][step] == pytest.approx(losses[one][step], rel=1e-5)


MESH = ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")


@pytest.mark.parametrize(
    ("overrides", "kwargs", "named"),
    [
        ((), {"method": "dpo"}, ["finetune.lora_rank", "finetune.dpo.reference=precomputed"]),
        (("finetune.dpo.beta=0",), {"method": "dpo", "lora_rank": 4}, ["finetune.dpo.beta=0"]),
        (
            ("finetune.dpo.reference=frozen",),
            {"method": "dpo", "lora_rank": 4},
            ["finetune.dpo.reference='frozen'", "adapters, precomputed, copy"],
        ),
        (("data=preference",), {}, ["method=dpo"]),
        (
            ("finetune.grpo.num_generations=4",),
            {"method": "dpo", "lora_rank": 4},
            ["finetune.grpo.num_generations=4 applies only to method=grpo", "is method=dpo"],
        ),
    ],
    ids=["reference-without-adapters", "beta", "reference", "pairs-without-dpo", "grpo-key"],
)
def test_bad_combinations_are_refused_before_anything_is_written(
    pair_file, tmp_path, overrides, kwargs, named
):
    workdir = tmp_path / "run"
    data = {} if "data=preference" in overrides else {"data": pair_file}
    extra = (f"data.path={pair_file}",) if not data else ()
    with pytest.raises(ZooError) as refused:
        zoo.finetune(CHECKPOINT, *SHORT, *overrides, *extra, f"workdir={workdir}", **data, **kwargs)
    for text in named:
        assert text in str(refused.value), str(refused.value)
    assert not workdir.exists()


def test_conversations_are_refused_by_dpo(tmp_path):
    chat = tmp_path / "chat.jsonl"
    chat.write_text(
        "".join(
            json.dumps(
                {"messages": [{"role": "user", "content": w}, {"role": "assistant", "content": w}]}
            )
            + "\n"
            for w in WORDS
        )
    )
    with pytest.raises(ZooError, match="trains on preference pairs"):
        zoo.finetune(
            CHECKPOINT,
            *SHORT,
            "data=chat",
            f"data.path={chat}",
            f"workdir={tmp_path / 'run'}",
            method="dpo",
            lora_rank=4,
        )

"""A fine-tune of a pretrained checkpoint takes the optimizer defaults of its kind (LoRA and
QLoRA: 2e-4; full: 2e-5; cosine decay, a warm-up of 3% of the steps, no weight decay) in place of
the model's from-scratch ones, said in one line, each key the user sets keeping its value; and
`trainer.epochs=N` trains ceil(N x training rows / batch size) steps, said in one line, refused
beside `trainer.steps`. The real run: a LoRA fine-tune of the tiny Qwen 2.5 chat checkpoint on a
file of 100 conversations for two epochs (24 steps of 8), its learning rates read back from
TensorBoard."""

from __future__ import annotations

import json
import logging
import math
import re

import pytest
from helpers import ROOT, read_events, scalar_steps

import zoo
from zoo.train import plan

PRETRAINED = ROOT / "tests" / "fixtures" / "pretrained"
CHAT = PRETRAINED / "qwen25-chat"
QWEN3 = f"finetune.init_from={PRETRAINED / 'qwen3-tiny'}"
LORA = "finetune.lora_rank=4"
BATCH = 8
TWO_EPOCHS = (
    "trainer.epochs=2",
    f"trainer.batch_size={BATCH}",
    "trainer.log_every=1",  # every step's learning rate in TensorBoard
    "data.eval_replies=0",
    "logging.norms_every=0",
)


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    """100 short conversations in a JSON Lines file."""
    path = tmp_path_factory.mktemp("conversations") / "sums.jsonl"
    with open(path, "w") as f:
        for i in range(100):
            a, b = i % 31, i % 17
            messages = [
                {"role": "user", "content": f"{a} + {b}?"},
                {"role": "assistant", "content": f"{a + b}."},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def training_rows(path, **params) -> int:
    """The training split's rows of data=chat on `path`, as the run reads it."""
    return len(zoo.load_data("chat", path=str(path), tokenizer=str(CHAT), **params).train)


@pytest.fixture(scope="module")
def two_epochs(conversations, tmp_path_factory):
    """Two epochs of LoRA on the conversations, with no optimizer key set: its result and
    train.log."""
    workdir = tmp_path_factory.mktemp("epochs") / "run"
    result = zoo.finetune(
        CHAT, *TWO_EPOCHS, f"workdir={workdir}", data=str(conversations), lora_rank=4
    )
    return result, (workdir / "train.log").read_text()


def test_epochs_run_the_steps_they_print(two_epochs, conversations):
    result, log = two_epochs
    rows = training_rows(conversations)
    steps = math.ceil(2 * rows / BATCH)  # a partial last batch is a whole step
    said = f"trainer.epochs=2: {steps} steps of {BATCH} rows over the {rows:,} training examples"
    assert said in log
    assert result.step == result.config.trainer.steps == steps
    assert max(scalar_steps(read_events(result.workdir), "train/loss")) == steps


def test_a_lora_finetune_of_a_checkpoint_trains_with_loras_defaults(two_epochs):
    result, log = two_epochs
    steps = result.config.trainer.steps
    warmup = round(0.03 * steps)
    assert warmup == 1  # so that the warm-up shows in the rates below
    said = (
        "fine-tuning defaults (LoRA): optimizer.name=adamw optimizer.learning_rate=0.0002 "
        "optimizer.schedule=cosine optimizer.weight_decay=0.0 optimizer.warmup_steps=1 "
        f"(3% of trainer.steps={steps})"
    )
    assert said in log
    # The rate each step's update used: a warm-up step from 0, then 2e-4 decaying to 0 along a
    # half cosine over the steps after it.
    rates = scalar_steps(read_events(result.workdir), "vitals/learning_rate")
    assert rates[1] == 0
    for step in range(2, steps + 1):
        cosine = 0.5 * (1 + math.cos(math.pi * (step - 2) / (steps - 1)))
        assert rates[step] == pytest.approx(2e-4 * cosine, rel=1e-5)


def test_resuming_the_finished_run_computes_the_same_steps(two_epochs, conversations):
    result, _ = two_epochs
    again = zoo.finetune(
        CHAT, *TWO_EPOCHS, f"workdir={result.workdir}", data=str(conversations), lora_rank=4
    )
    assert (again.start_step, again.step) == (result.step, result.step)


def test_packed_epochs_count_packed_rows(conversations, caplog):
    packing = ["data.packing=true", "data.buckets=[512]"]
    with caplog.at_level(logging.INFO, logger="zoo"):
        cfg = zoo.compose(
            [
                f"finetune.init_from={CHAT}",
                "data=chat",
                f"data.path={conversations}",
                "trainer.epochs=3",
                "trainer.batch_size=8",
                *packing,
            ]
        )
    rows = training_rows(conversations, packing=True, buckets=[512])
    assert rows <= training_rows(conversations) / 4  # several conversations to a row
    assert cfg.trainer.steps == math.ceil(3 * rows / 8)
    assert f"over the {rows:,} packed training rows of data set 'chat'" in caplog.text


def test_epochs_round_up_to_the_steps_per_dispatch_set(caplog):
    text = [QWEN3, "data=text", f"data.path={PRETRAINED / 'tiny.txt'}", "data.window=16"]
    tokenizer = str(PRETRAINED / "qwen3-tiny")
    text_file = str(PRETRAINED / "tiny.txt")
    windows = zoo.load_data("text", path=text_file, window=16, tokenizer=tokenizer).train
    rows = len(windows["tokens"])
    dispatch = ["trainer.steps_per_dispatch=7", "trainer.log_every=7"]
    with caplog.at_level(logging.INFO, logger="zoo"):
        cfg = zoo.compose([*text, "trainer.epochs=1", "trainer.batch_size=8"])
        dispatched = zoo.compose([*text, "trainer.epochs=1", "trainer.batch_size=8", *dispatch])
    assert cfg.trainer.steps == math.ceil(rows / 8)
    assert dispatched.trainer.steps == 7 * math.ceil(math.ceil(rows / 8) / 7)
    assert "(rounded up to a multiple of trainer.steps_per_dispatch=7)" in caplog.text


def test_epochs_beside_steps_are_refused_before_anything_is_written(tmp_path):
    workdir = tmp_path / "run"
    (job,) = plan(
        [QWEN3, "trainer.epochs=2", "trainer.steps=5", f"workdir={workdir}"], multirun=False
    )
    assert job.config is None
    assert job.error.startswith("trainer.epochs=2 and trainer.steps=5 are both set")
    assert not workdir.exists()
    with pytest.raises(zoo.ZooError, match=r"trainer\.epochs=2 and trainer\.steps=5 are both"):
        zoo.finetune(PRETRAINED / "qwen3-tiny", "trainer.epochs=2", "trainer.steps=5")


@pytest.mark.parametrize(
    ("overrides", "kind", "rate"),
    [
        ([QWEN3, LORA], "LoRA", 2e-4),
        ([QWEN3, LORA, "finetune.quantize=nf4"], "QLoRA", 2e-4),
        ([QWEN3], "full", 2e-5),
        # a fresh head alone on a checkpoint's frozen backbone: trained from scratch
        ([f"finetune.init_from={PRETRAINED / 'vit-hf'}", "finetune.freeze=backbone"], None, 2e-3),
        (["model=decoder"], None, 3e-3),  # fresh weights
    ],
    ids=["lora", "qlora", "full", "head", "fresh"],
)
def test_the_defaults_follow_the_kind_of_finetune(overrides, kind, rate, caplog):
    with caplog.at_level(logging.INFO, logger="zoo"):
        cfg = zoo.compose([*overrides, "trainer.steps=200"])
    said = [r.getMessage() for r in caplog.records if "fine-tuning defaults" in r.getMessage()]
    assert cfg.optimizer.learning_rate == rate
    if kind is None:
        assert not said
        return
    (line,) = said
    assert line.startswith(f"fine-tuning defaults ({kind}): ")
    optimizer = cfg.optimizer
    assert (optimizer.name.value, optimizer.schedule.value) == ("adamw", "cosine")
    assert (optimizer.warmup_steps, optimizer.weight_decay) == (6, 0.0)


def test_a_value_the_user_sets_wins(caplog):
    chosen = ["optimizer.learning_rate=1e-3", "optimizer.warmup_steps=0"]
    with caplog.at_level(logging.INFO, logger="zoo"):
        cfg = zoo.compose([QWEN3, LORA, "trainer.steps=200", *chosen])
    assert (cfg.optimizer.learning_rate, cfg.optimizer.warmup_steps) == (1e-3, 0)
    assert cfg.optimizer.weight_decay == 0.0  # the keys not set still take the defaults
    (line,) = [r.getMessage() for r in caplog.records if "fine-tuning defaults" in r.getMessage()]
    assert "optimizer.weight_decay=0.0" in line
    assert not re.search(r"optimizer\.(learning_rate|warmup_steps)=", line)

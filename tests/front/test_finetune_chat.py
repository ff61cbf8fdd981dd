"""Fine-tuning a chat checkpoint on conversations: `python -m zoo.train finetune.init_from=DIR
data=chat data.path=FILE` in a subprocess, and `zoo.finetune(DIR, data=[...])` on conversations
given from Python (written once to the data cache, read as `data=chat` reads files), each
training on the replies alone and logging how many tokens carry loss."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, read_events, run_cli, scalar_steps
from omegaconf import OmegaConf

import zoo

CONVERSATIONS = [
    [
        {"role": "user", "content": f"Name a prime above {n}."},
        {"role": "assistant", "content": f"{p}."},
    ]
    for n, p in [(1, 2), (2, 3), (4, 5), (6, 7), (8, 11), (12, 13), (14, 17), (18, 19)]
]
FIXTURES = ROOT / "tests" / "fixtures"
STEPS = ("trainer.steps=2", "trainer.batch_size=8", "trainer.log_every=1", "trainer.eval_every=2")


@pytest.fixture(scope="module")
def checkpoint():
    """A tiny Qwen 2.5 chat checkpoint: its real chat template, a tokenizer with its special
    tokens."""
    return FIXTURES / "pretrained" / "qwen25-chat"


def test_the_command_line_fine_tunes_on_a_file_of_conversations(checkpoint, tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    workdir = tmp_path / "run"
    done = run_cli(
        f"finetune.init_from={checkpoint}",
        "data=chat",
        f"data.path={data}",
        *STEPS,
        f"workdir={workdir}",
        env={"ZOO_DATA_DIR": str(tmp_path / "cache")},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Training decoder on chat for 2 steps" in done.stdout + done.stderr
    loss_tokens = scalar_steps(read_events(workdir), "train/loss_tokens")
    assert sorted(loss_tokens) == [1, 2] and all(v > 0 for v in loss_tokens.values())


def test_python_fine_tunes_on_conversations_given_as_a_list(checkpoint, tmp_path):
    result = zoo.finetune(checkpoint, *STEPS, f"workdir={tmp_path / 'run'}", data=CONVERSATIONS)
    config = OmegaConf.load(tmp_path / "run" / ".hydra" / "config.yaml")
    assert config.data.name == "chat" and config.data.loss_on == "assistant"
    lines = Path(config.data.path).read_text().splitlines()
    written = [json.loads(line)["messages"] for line in lines]
    assert written == CONVERSATIONS
    assert result.step == 2 and np.isfinite(result.eval_metrics["loss"])
    assert result.eval_metrics["loss_tokens"] > 0
    # The same conversations are the same file, so the same call resumes the finished run.
    again = zoo.finetune(checkpoint, *STEPS, f"workdir={tmp_path / 'run'}", data=CONVERSATIONS)
    assert again.start_step == 2


def test_a_list_that_is_not_conversations_is_refused(checkpoint):
    with pytest.raises(zoo.ZooError, match="Conversation 0 holds something that is not JSON"):
        zoo.finetune(checkpoint, data=[[{"role": "user", "content": object()}]])

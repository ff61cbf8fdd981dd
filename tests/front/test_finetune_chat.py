"""Fine-tuning a chat checkpoint on conversations: `python -m zoo.train finetune.init_from=DIR
data=chat data.path=FILE` in a subprocess (Qwen 2.5's checkpoint), and `zoo.finetune(DIR,
data=[...])` on conversations given from Python (written once to the data cache, read as
`data=chat` reads files; Qwen 3's checkpoint, thinking off), each training on the replies alone
and logging how many tokens carry loss; at each eval, the replies to held-out prompts in
TensorBoard's text tab."""

from __future__ import annotations

import importlib
import io
import json
import logging
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, TWO_LOGGED_STEPS, read_events, run_cli, running, scalar_steps
from omegaconf import OmegaConf

import zoo
from zoo.plugin import LOSS_MASK
from zoo.serve import create_app
from zoo.text_generation import chat_prompt

zoo_chat = importlib.import_module("zoo.chat")

CONVERSATIONS = [
    [
        {"role": "user", "content": f"Name a prime above {n}."},
        {"role": "assistant", "content": f"{p}."},
    ]
    for n, p in [(1, 2), (2, 3), (4, 5), (6, 7), (8, 11), (12, 13), (14, 17), (18, 19)]
]
FIXTURES = ROOT / "tests" / "fixtures"
STEPS = (
    *TWO_LOGGED_STEPS,
    "logging.norms_every=0",  # no norms at the first step: a gradient's compilation less
)
REPLIES = (
    "trainer.eval_every=1",
    "trainer.checkpoint_every=1",
    "optimizer.learning_rate=1e-4",  # replies that are more than an end of turn at once
    "data.eval_fraction=0.5",
    "data.eval_replies=2",
    "data.eval_reply_tokens=6",
)


@pytest.fixture(scope="module")
def checkpoint():
    """A tiny Qwen 2.5 chat checkpoint: its real chat template, a tokenizer with its special
    tokens."""
    return FIXTURES / "pretrained" / "qwen25-chat"


# Qwen 3's thinking switch, from training to chatting: a run fine-tuned with
# data.template_kwargs={enable_thinking:false} is asked with it by default.
QWEN3 = FIXTURES / "pretrained" / "qwen3-chat"
THINKING_OFF = {"enable_thinking": False}
PYTHON_RUN = (*STEPS, *REPLIES, "data.template_kwargs={enable_thinking:false}")


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """Two steps of Qwen 3's chat checkpoint on the conversations given from Python, thinking
    off, an eval and a checkpoint after each, writing the replies to two held-out prompts."""
    workdir = tmp_path_factory.mktemp("chat") / "run"
    return zoo.finetune(QWEN3, *PYTHON_RUN, f"workdir={workdir}", data=CONVERSATIONS)


def test_the_command_line_fine_tunes_on_a_file_of_conversations(checkpoint, tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    workdir = tmp_path / "run"
    done = run_cli(
        f"finetune.init_from={checkpoint}",
        "data=chat",
        f"data.path={data}",
        *STEPS,
        "data.eval_replies=0",
        f"workdir={workdir}",
        env={"ZOO_DATA_DIR": str(tmp_path / "cache")},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Training decoder on chat for 2 steps" in done.stdout + done.stderr
    events = read_events(workdir)
    loss_tokens = scalar_steps(events, "train/loss_tokens")
    assert sorted(loss_tokens) == [1, 2] and all(v > 0 for v in loss_tokens.values())
    # No replies: the eval continues the first held-out example instead, as for text.
    texts = events.Tags()["tensors"]
    assert "sample/text_summary" in texts and not [t for t in texts if t.startswith("replies")]


def test_python_fine_tunes_on_conversations_given_as_a_list(finetuned):
    config = OmegaConf.load(Path(finetuned.workdir) / ".hydra" / "config.yaml")
    assert config.data.name == "chat" and config.data.loss_on == "assistant"
    lines = Path(config.data.path).read_text().splitlines()
    written = [json.loads(line)["messages"] for line in lines]
    assert written == CONVERSATIONS
    assert finetuned.step == 2 and np.isfinite(finetuned.eval_metrics["loss"])
    # The same conversations are the same file, so the same call resumes the finished run.
    again = zoo.finetune(QWEN3, *PYTHON_RUN, f"workdir={finetuned.workdir}", data=CONVERSATIONS)
    assert again.start_step == 2


def test_the_held_out_loss_tokens_are_the_real_examples(finetuned):
    """The eval batch of 8 holds the few held-out conversations and padding rows, which count
    for nothing."""
    data = OmegaConf.to_container(finetuned.config.data)
    held_out = zoo.load_data("chat", **{k: v for k, v in data.items() if k != "name"}).eval
    assert 0 < len(held_out) < 8
    batch = held_out.examples(np.arange(len(held_out)), None, 0)
    assert finetuned.eval_metrics["loss_tokens"] == batch[LOSS_MASK].sum()


def blocks(markdown: str) -> dict[str, str]:
    """A text entry's parts: `**name**` and its indented block (a trailing line break is not
    shown)."""
    parts = markdown.split("**")[1:]
    return {
        name: "\n".join(line[4:] for line in text.strip("\n").split("\n"))
        for name, text in zip(parts[::2], parts[1::2])
    }


def test_each_eval_writes_the_replies_that_generation_gives(finetuned):
    events = read_events(finetuned.workdir)
    asked = {c[1]["content"]: c[0] for c in CONVERSATIONS}
    seen = set()
    for index in range(2):
        entries = events.Tensors(f"replies/{index}/text_summary")
        assert [e.step for e in entries] == [1, 2]
        for entry in entries:
            shown = blocks(entry.tensor_proto.string_val[0].decode())
            messages = [asked[shown["reference"]]]
            assert shown["prompt"] == chat_prompt(finetuned, messages)[0].removesuffix("\n")
            at_step = zoo.load(finetuned.workdir, step=entry.step)
            reply = zoo.generate(at_step, messages=messages, temperature=0, max_new_tokens=6)
            assert shown["reply"] == reply.removesuffix("\n")
            seen.add((entry.step, reply))
    assert any(reply for _, reply in seen)  # the model writes before its end of turn


def test_a_list_that_is_not_conversations_is_refused(checkpoint):
    with pytest.raises(zoo.ZooError, match="Conversation 0 holds something that is not JSON"):
        zoo.finetune(checkpoint, data=[[{"role": "user", "content": object()}]])


EMPTY_THINKING = "<think>\n\n</think>\n\n"
ASKED = [{"role": "user", "content": "Name a prime above 20."}]
GREEDY = {"temperature": 0, "max_new_tokens": 6}
SAMPLED = {"temperature": 1.0, "max_new_tokens": 8, "seed": 0}
"""Sampled, the replies of the tiny model tell its prompts apart (its greedy ones do not)."""


def test_a_run_trained_without_thinking_is_asked_without_it(finetuned, caplog):
    loaded = zoo.load(finetuned.workdir)
    for run in (finetuned, loaded):
        assert chat_prompt(run, ASKED)[0].endswith("assistant\n" + EMPTY_THINKING)
    checkpoint = zoo.load(QWEN3)  # trained with no template variables: thinking on
    assert chat_prompt(checkpoint, ASKED)[0].endswith("assistant\n")

    def first_logprob(**given):
        reply = zoo.generate(loaded, messages=ASKED, logprobs=True, **GREEDY, **given)
        return reply.logprobs[0]

    with caplog.at_level(logging.WARNING, logger="zoo"):
        by_default = first_logprob()
        assert not caplog.records
        assert by_default == first_logprob(chat_template_kwargs=THINKING_OFF)
        assert by_default != first_logprob(chat_template_kwargs={"enable_thinking": True})
    # Switching thinking back on is the caller's to do, and said, naming both values.
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "enable_thinking=True differs from the enable_thinking=False" in warning
    assert finetuned.workdir in warning


def chat_in_process(*arguments: str, turns: str = "Name a prime above 20.\n") -> str:
    """`python -m zoo.chat ARGUMENTS` run by its `main` on `turns`: what it printed."""
    out = io.StringIO()
    assert zoo_chat.main(list(arguments), io.StringIO(turns), out) == 0
    return out.getvalue()


def test_the_terminal_chat_asks_the_run_as_it_trained(finetuned, caplog):
    loaded = zoo.load(finetuned.workdir)
    off, on = (
        zoo.generate(loaded, messages=ASKED, **SAMPLED, chat_template_kwargs={"enable_thinking": v})
        for v in (False, True)
    )
    assert off != on  # the two prompts lead this model to different replies
    options = [f"{key}={value}" for key, value in SAMPLED.items()]
    assert chat_in_process(finetuned.workdir, *options) == off + "\n"
    # Typed as overrides are: `false` is False (the text 'false' would turn thinking on).
    assert chat_in_process(str(QWEN3), *options, "template.enable_thinking=false") == (
        zoo.generate(QWEN3, messages=ASKED, **SAMPLED, chat_template_kwargs=THINKING_OFF) + "\n"
    )
    # Thinking back on, for two turns: said once, before the first.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="zoo"):
        two_turns = "Name a prime above 20.\nAnother?\n"
        printed = chat_in_process(
            finetuned.workdir, *options, "template.enable_thinking=true", turns=two_turns
        )
    assert printed.startswith(on + "\n") and printed.count("\n") == 2
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "enable_thinking=True differs from the enable_thinking=False" in warning


def test_the_server_of_the_run_asks_it_as_it_trained(finetuned):
    """`zoo.serve` of the run's workdir renders a chat with the template variables the run
    trained with (thinking off) unless the request gives others, as `zoo.generate` of the
    workdir does: its replies are `zoo.generate`'s, either way. The app's shapes are
    tests/front/test_serve_queue.py's (compiled once in a session)."""
    app = create_app(finetuned.workdir, name="run", rows=1, max_length=64, queue_size=2)
    off, on = (
        zoo.generate(finetuned.workdir, messages=ASKED, **SAMPLED, chat_template_kwargs=kwargs)
        for kwargs in (None, {"enable_thinking": True})
    )
    assert off != on  # the two prompts lead this model to different replies
    settings = {"max_tokens": SAMPLED["max_new_tokens"], "temperature": 1.0, "seed": 0}
    with running(app) as client:
        replies = [
            client.chat.completions.create(model="run", messages=ASKED, **settings, extra_body=e)
            for e in (None, {"chat_template_kwargs": {"enable_thinking": True}})
        ]
    assert [r.choices[0].message.content for r in replies] == [off, on]


@pytest.mark.parametrize(
    "argument, said",
    [
        ("template.enable_thinkng=false", "reads no variable named 'enable_thinkng'"),
        ("template.a.b=1", "'template.a.b=1' names no chat template variable"),
        ("template.enable_thinking=true,false", "gives several values"),
        ("template.enable_thinking", "Cannot read 'template.enable_thinking' as KEY=VALUE"),
    ],
)
def test_a_bad_template_argument_is_refused_by_name(argument, said, capsys):
    out = io.StringIO()
    assert zoo_chat.main([str(QWEN3), argument], io.StringIO("hello\n"), out) == 2
    assert said in capsys.readouterr().err and out.getvalue() == ""


def test_template_arguments_are_typed_as_overrides_are():
    arguments = ["template.enable_thinking=false", "template.n=3", "template.day=26 Jul 2024"]
    assert zoo_chat.template_arguments(arguments) == {
        "enable_thinking": False,
        "n": 3,
        "day": "26 Jul 2024",
    }

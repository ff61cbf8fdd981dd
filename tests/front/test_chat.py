"""`zoo.generate(model, messages=...)` replies as transformers does for each chat fixture
(Llama 3.1, Qwen 2.5, Qwen 3, Gemma 3: its template rendered, the reply ending at the end of
turn; tests/fixtures/pretrained/*-chat/chat_reference.json); `python -m zoo.chat DIR` keeps the
conversation; and the Python API's other forms: lists of prompts, a stream, log-probabilities,
stop strings from the command line."""

from __future__ import annotations

import importlib
import io
import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import ROOT
from zoo.data.text import load_tokenizer
from zoo.models.sampling_loop import Completion
from zoo.models.text_completion import Codec

import zoo

FIXTURES = ROOT / "tests" / "fixtures" / "pretrained"
CHATS = ("llama3-chat", "qwen25-chat", "qwen3-chat", "gemma3-chat")
BOS = {"llama3-chat": "<|begin_of_text|>", "gemma3-chat": "<bos>"}
zoo_chat = importlib.import_module("zoo.chat")


@pytest.fixture(scope="module", params=CHATS)
def checkpoint(request):
    name = request.param
    reference = json.loads((FIXTURES / name / "chat_reference.json").read_text())
    return name, zoo.load(FIXTURES / name, devices=jax.devices()[:1]), reference


def test_a_reply_to_messages_is_transformers_greedy_reply(checkpoint):
    name, trained, reference = checkpoint
    tokenizer = load_tokenizer(FIXTURES / name)
    for conversation in reference["conversations"].values():
        ids = conversation["greedy_ids"]
        kept = ids[:-1] if conversation["stopped_at_eos"] else ids
        expected = tokenizer.decode(kept, skip_special_tokens=False)
        reply = zoo.generate(
            trained,
            messages=conversation["messages"],
            max_new_tokens=len(ids),
            temperature=0,
            chat_template_kwargs=conversation["template_kwargs"],
        )
        assert reply == expected, conversation["messages"]
    assert any(c["stopped_at_eos"] for c in reference["conversations"].values())


def test_a_plain_prompt_is_encoded_and_continued_as_transformers_does(checkpoint):
    """A text prompt gets the BOS that Llama's and Gemma's tokenizers prepend (Qwen's add
    none), and the greedy continuation is transformers' after those ids; the chat template's
    rendering is encoded without, since it writes its own BOS."""
    name, trained, reference = checkpoint
    plain, tokenizer = reference["plain_prompt"], load_tokenizer(FIXTURES / name)
    assert Codec(tokenizer).encode(plain["text"]).tolist() == plain["ids"]
    bos = reference["special_tokens"].get(BOS.get(name))
    assert (plain["ids"][0] == bos) == (name in BOS)
    rendered = reference["conversations"]["system-user"]
    ids = Codec(tokenizer, rendered=True).encode(rendered["prompt"]).tolist()
    assert ids == rendered["prompt_ids"]
    (written,) = zoo.generate(
        trained,
        [plain["text"]],
        max_new_tokens=len(plain["greedy_ids"]),
        temperature=0,
        eos=(),
        logprobs=True,
    )
    assert written.tokens == plain["greedy_ids"]


def test_the_terminal_chat_keeps_the_conversation():
    directory = FIXTURES / "qwen3-chat"
    turns = ["Name a colour.", "And another one?"]
    result = subprocess.run(
        [sys.executable, "-m", "zoo.chat", str(directory), "max_new_tokens=6", "temperature=0"],
        cwd=ROOT,
        input="\n".join(turns) + "\n",
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    messages, replies = [], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        replies.append(zoo.generate(directory, messages=messages, max_new_tokens=6, temperature=0))
        messages.append({"role": "assistant", "content": replies[-1]})
    assert result.stdout == "".join(reply + "\n" for reply in replies)


def test_the_chat_refuses_a_model_without_a_template(capsys):
    code = zoo_chat.main([str(FIXTURES / "llama-tiny")], io.StringIO("hello\n"), io.StringIO())
    assert code == 2
    assert "has no chat template" in capsys.readouterr().err


def test_prompts_in_a_batch_a_stream_and_log_probabilities():
    directory = FIXTURES / "qwen3-tiny"
    prompts = ["The", "Once upon a time there was", "def"]
    settings = {"max_new_tokens": 8, "temperature": 0.8, "top_p": 0.9, "seed": 5}
    batch = zoo.generate(directory, prompts, **settings)
    first = zoo.generate(directory, prompts[0], **settings)  # row 0 draws as a prompt alone
    pieces = list(zoo.generate(directory, prompts[0], **settings, stream=True))
    scored = zoo.generate(directory, prompts, **settings, logprobs=True)
    ids = np.asarray(load_tokenizer(directory).encode(prompts[0]).ids)  # token ids as a prompt
    assert zoo.generate(directory, ids, **settings) == first
    assert isinstance(batch, list) and batch[0] == first == "".join(pieces)
    assert [row.text for row in scored] == batch
    assert all(isinstance(row, Completion) for row in scored)
    assert all(len(row.logprobs) == len(row.tokens) > 0 for row in scored)
    assert all(p < 0 for row in scored for p in row.logprobs)


def test_generate_cli_stops_at_a_stop_string():
    directory = FIXTURES / "llama-tiny"
    text = zoo.generate(directory, "The", max_new_tokens=12, temperature=0)
    stop = text[4:7]
    result = subprocess.run(
        [sys.executable, "-m", "zoo.generate", str(directory), "prompt=The"]
        + ["max_new_tokens=12", "temperature=0", f"stop={stop}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "The" + text.split(stop)[0] + "\n"


def test_messages_need_a_chat_checkpoint():
    with pytest.raises(zoo.ZooError, match="a prompt or messages"):
        zoo.generate(FIXTURES / "qwen3-chat", "hi", messages=[{"role": "user", "content": "x"}])
    model = zoo.load(FIXTURES / "qwen3-tiny", devices=jax.devices()[:1])
    with pytest.raises(zoo.ZooError, match="needs a chat checkpoint"), model.activate():
        zoo.generate(model.model, messages=[{"role": "user", "content": "x"}])

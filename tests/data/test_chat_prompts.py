"""`data=chat`'s held-out prompts, whose replies each eval writes (`data.eval_replies`), and the
chat template's further variables (`data.template_kwargs`), on the Qwen 3 chat checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT
from zoo.data.chat_template import ChatTemplate, end_of_turn_ids
from zoo.data.text import load_tokenizer
from zoo.engine.errors import ZooError

import zoo

CHECKPOINT = ROOT / "tests" / "fixtures" / "pretrained" / "qwen3-chat"
TWO_TURNS = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Name a prime."},
    {"role": "assistant", "content": "Seven."},
]

pytestmark = pytest.mark.usefixtures("cache")  # a data cache of its own


@pytest.fixture
def data(tmp_path) -> Path:
    """A train/ and a val/ file; held out: a two-turn conversation, a prompt and completion,
    and a conversation whose reply lies beyond the largest bucket (no held-out example)."""
    for split in ("train", "val"):
        (tmp_path / split).mkdir()
    train = [{"messages": [{"role": "user", "content": f"q{i}"}, TWO_TURNS[1]]} for i in range(4)]
    held = [
        {"messages": TWO_TURNS},
        {"prompt": "Name a prime above 5.", "completion": "7."},
        {"messages": [{"role": "user", "content": "word " * 200}, TWO_TURNS[1]]},
        {
            "messages": [
                {"role": "user", "content": "Bye"},
                {"role": "assistant", "content": "Bye."},
            ]
        },
    ]
    for split, rows in (("train", train), ("val", held)):
        (tmp_path / split / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def rendered(messages: list, **kwargs) -> str:
    return ChatTemplate.load(CHECKPOINT).render(messages, True, **kwargs)


def test_the_prompts_are_the_held_out_conversations_before_their_last_reply(data):
    splits = zoo.load_data(
        "chat", path=str(data), tokenizer=str(CHECKPOINT), buckets=[64, 128], eval_replies=3
    )
    prompts = splits.prompts()
    tokenizer = load_tokenizer(CHECKPOINT / "tokenizer.json")
    user = {"role": "user", "content": "Name a prime above 5."}
    # The third held-out conversation is no example (its reply lies beyond 128 tokens).
    expected = [
        (TWO_TURNS[:3], "Seven."),
        ([user], "7."),
        ([{"role": "user", "content": "Bye"}], "Bye."),
    ]
    assert [(p.text, p.reference) for p in prompts] == [(rendered(m), r) for m, r in expected]
    for prompt in prompts:
        ids = tokenizer.encode(prompt.text, add_special_tokens=False).ids
        np.testing.assert_array_equal(prompt.ids, ids)
        assert set(prompt.end_of_turn) == set(end_of_turn_ids(CHECKPOINT))
        assert prompt.max_new_tokens == 64  # data.eval_reply_tokens' default, within the bucket
    assert splits.prompts() is prompts  # read from the files once


def test_the_count_and_the_reply_length_are_options(data):
    def prompts(**options):
        return zoo.load_data(
            "chat", path=str(data), tokenizer=str(CHECKPOINT), buckets=[128], **options
        ).prompts()

    assert prompts(eval_replies=0) == []
    (one,) = prompts(eval_replies=1, eval_reply_tokens=5)
    assert one.reference == "Seven." and one.max_new_tokens == 5
    # A reply may take no more than the room the largest bucket leaves after its prompt.
    (roomy,) = prompts(eval_replies=1, eval_reply_tokens=1000)
    assert roomy.max_new_tokens == 128 - len(roomy.ids) > 0


def test_template_kwargs_reach_the_template_and_the_cache_key(data, cache):
    # loss_on=completion: with enable_thinking=false, Qwen 3 renders an earlier reply without
    # the empty thinking block that the opening of a turn then writes, so only the last reply
    # of a conversation of two can be found.
    options = {"path": str(data), "tokenizer": str(CHECKPOINT), "loss_on": "completion"}
    off = {"enable_thinking": False}
    default = zoo.load_data("chat", **options, eval_replies=1)
    thinking_off = zoo.load_data("chat", **options, eval_replies=1, template_kwargs=off)
    (prompt,), (prompt_off,) = default.prompts(), thinking_off.prompts()
    assert prompt_off.text == rendered(TWO_TURNS[:3], **off) != prompt.text
    assert prompt_off.text.endswith("<think>\n\n</think>\n\n")
    assert len(prompt_off.ids) > len(prompt.ids)
    # Rendered as the prompt, the empty thinking block opens the reply instead of being trained.
    trained = [s.eval.encoded.trained.sum() for s in (default, thinking_off)]
    assert trained[1] < trained[0]
    assert len(list((cache / "chat").glob("*.npz"))) == 4  # train and val, for each setting


@pytest.mark.parametrize(
    "options, match",
    [
        ({"template_kwargs": ["enable_thinking"]}, r"data.template_kwargs=\['enable_thinking'\]"),
        ({"template_kwargs": {1: True}}, r"data.template_kwargs=\{1: True\} is not a mapping"),
        ({"eval_replies": -1}, r"data.eval_replies=-1 must be 0"),
        ({"eval_reply_tokens": 0}, r"data.eval_reply_tokens=0 must be at least 1"),
    ],
)
def test_bad_options_are_refused_by_name(data, options, match):
    with pytest.raises(ZooError, match=match):
        zoo.load_data("chat", path=str(data), tokenizer=str(CHECKPOINT), **options)

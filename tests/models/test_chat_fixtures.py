"""The chat fixtures (`tests/fixtures/pretrained/make_chat_fixtures.py`: tiny random Llama 3.1,
Qwen 2.5, Qwen 3 and Gemma 3 chat checkpoints with their real chat templates) against what
transformers did with them (`chat_reference.json`): zoo loads each with transformers' logits for
the rendered prompts, renders each conversation byte for byte as transformers does, tokenizes
the rendered text into transformers' ids, and reads the end-of-turn ids.

Tokenizing a rendered conversation: the templates that start with a BOS token (Llama's
`<|begin_of_text|>`, Gemma's `<bos>`) render it themselves, and the same checkpoints'
tokenizers prepend it to whatever they encode; transformers' `apply_chat_template` encodes the
rendered text with `add_special_tokens=False`, so that it holds one BOS. zoo encodes it the
same way; encoding it with the tokenizer's special tokens would read the BOS twice."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer

import zoo
from zoo.chat_template import ChatTemplate, end_of_turn_ids, read_chat_template

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "pretrained"
REFERENCE = "chat_reference.json"
NAMES = sorted(d.name for d in FIXTURES.iterdir() if (d / REFERENCE).is_file())
FAMILIES = {
    "llama3-chat": "llama",
    "qwen25-chat": "qwen2",
    "qwen3-chat": "qwen3",
    "gemma3-chat": "gemma3_text",
}


def reference(name: str) -> dict:
    return json.loads((FIXTURES / name / REFERENCE).read_text(encoding="utf-8"))


CASES = [(name, case) for name in NAMES for case in reference(name)["conversations"]]


def tokenizer(name: str) -> Tokenizer:
    return Tokenizer.from_file(str(FIXTURES / name / "tokenizer.json"))


def test_one_chat_fixture_per_family():
    assert {
        n: json.loads((FIXTURES / n / "config.json").read_text())["model_type"] for n in NAMES
    } == FAMILIES
    sources = {reference(name)["template_file"] for name in NAMES}
    assert sources == {"chat_template.jinja", "tokenizer_config.json"}


@pytest.mark.parametrize("name", NAMES)
def test_template_and_special_tokens_are_where_the_reference_says(name):
    directory, expected = FIXTURES / name, reference(name)
    jinja = (directory / "chat_template.jinja").is_file()
    assert jinja == (expected["template_file"] == "chat_template.jinja")
    assert read_chat_template(directory) is not None
    vocab = json.loads((directory / "config.json").read_text())["vocab_size"]
    loaded = tokenizer(name)
    for token, token_id in {**expected["special_tokens"], **expected["added_tokens"]}.items():
        assert loaded.token_to_id(token) == token_id < vocab, token


@pytest.mark.parametrize(("name", "case"), CASES)
def test_renders_as_transformers(name, case):
    conversation = reference(name)["conversations"][case]
    template = ChatTemplate.load(FIXTURES / name)
    extra = conversation["template_kwargs"]
    assert template.render(conversation["messages"], **extra) == conversation["prompt"]
    if "full_messages" in conversation:
        full = template.render(conversation["full_messages"], add_generation_prompt=False, **extra)
        assert full == conversation["full_text"]


@pytest.mark.parametrize(("name", "case"), CASES)
def test_tokenizes_as_transformers(name, case):
    """The rendered text encoded without the tokenizer's own special tokens gives transformers'
    ids, its BOS (where the template renders one) once."""
    conversation, encode = reference(name)["conversations"][case], tokenizer(name).encode
    ids = encode(conversation["prompt"], add_special_tokens=False).ids
    assert ids == conversation["prompt_ids"]
    if "full_text" in conversation:
        assert (
            encode(conversation["full_text"], add_special_tokens=False).ids
            == (conversation["full_ids"])
        )


@pytest.mark.parametrize(("name", "case"), CASES)
def test_decodes_as_transformers(name, case):
    conversation, decode = reference(name)["conversations"][case], tokenizer(name).decode
    assert (
        decode(conversation["greedy_ids"], skip_special_tokens=False)
        == (conversation["greedy_text"])
    )
    if "full_ids" in conversation:
        assert (
            decode(conversation["full_ids"], skip_special_tokens=False)
            == (conversation["full_text"])
        )


@pytest.mark.parametrize("name", NAMES)
def test_a_tokenizer_that_adds_bos_would_read_it_twice(name):
    """Why the rendered text is encoded with `add_special_tokens=False`: Llama's and Gemma's
    tokenizers prepend the BOS their templates already render; Qwen's add nothing."""
    expected, loaded = reference(name), tokenizer(name)
    prompt_ids = expected["conversations"]["system-user"]["prompt_ids"]
    with_specials = loaded.encode(expected["conversations"]["system-user"]["prompt"]).ids
    if expected["tokenizer_adds_bos"]:
        assert with_specials == prompt_ids[:1] + prompt_ids
        assert loaded.id_to_token(prompt_ids[0]) in ("<|begin_of_text|>", "<bos>")
    else:
        assert with_specials == prompt_ids
        assert name.startswith("qwen")


@pytest.mark.parametrize("name", NAMES)
def test_end_of_turn_ids(name):
    """`end_of_turn_ids` reads generation_config's list; each fixture has a conversation whose
    greedy reply ends with its end-of-turn token."""
    expected = reference(name)
    end_of_turn = expected["end_of_turn"]["id"]
    assert end_of_turn in expected["eos_token_ids"]
    assert end_of_turn_ids(FIXTURES / name) == tuple(expected["eos_token_ids"])
    stops = expected["conversations"]["stops"]
    assert stops["stopped_at_eos"] and stops["greedy_ids"][-1] == end_of_turn
    assert len(stops["greedy_ids"]) > 2  # a reply of a few tokens, then the end of its turn


@pytest.fixture(scope="module")
def loaded() -> dict[str, zoo.TrainedModel]:
    return {name: zoo.load(FIXTURES / name, devices=jax.devices()[:1]) for name in NAMES}


@pytest.mark.parametrize(("name", "case"), CASES)
def test_logits_of_the_rendered_prompt_match_transformers(loaded, name, case):
    conversation = reference(name)["conversations"][case]
    with jax.default_matmul_precision("highest"):
        logits = zoo.predict(loaded[name], np.asarray([conversation["prompt_ids"]], np.int32))
    expected = np.asarray(conversation["logits"], np.float32)
    got = np.asarray(logits)[0, conversation["logits_positions"], : expected.shape[-1]]
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
    assert got[-1].argmax() == conversation["greedy_ids"][0]

"""`data=chat`: conversations from JSON Lines and Parquet files (and folders of them), rendered
with a checkpoint's real chat template (Llama 3.1, Qwen 2.5, Qwen 3, Gemma 3, and a ChatML one
with `{% generation %}` markers), tokenised once into the cache, with a loss mask over exactly
the replies; bad rows named, skipped or refused; the language-model loss weighted by the mask."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from flax import nnx
from helpers import ROOT, write_jsonl
from zoo.data.chat_tokens import Encoder
from zoo.data.conversations import DEFAULT_ROLES, Columns, conversation
from zoo.data.text import load_tokenizer
from zoo.engine.errors import ZooError
from zoo.models.language_model import language_model_loss

import zoo

TEMPLATES = ROOT / "tests" / "fixtures" / "chat_templates"
TOKENIZER = ROOT / "tests" / "fixtures" / "pretrained" / "qwen3-tiny" / "tokenizer.json"
SPECIAL = [
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<bos>",
    "<eos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<think>",
    "</think>",
]
"""The tokens the templates write, added to a tiny BPE tokenizer as its special tokens."""
END_OF_TURN = {"gemma-3-it": ["<eos>", "<end_of_turn>"]}
"""A checkpoint's generation config lists its end of turn beside its eos_token (Gemma 3's
`eos_token_id` is [1, 106]: `<eos>` and `<end_of_turn>`)."""

TWO_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "See you."},
]
REPLIES = {
    "llama-3.1-instruct": ["Hello!<|eot_id|>", "See you.<|eot_id|>"],
    "qwen2.5-instruct": ["Hello!<|im_end|>", "See you.<|im_end|>"],
    # Qwen 3 writes an empty thinking block into the last reply, which the model writes too.
    "qwen3": ["Hello!<|im_end|>", "<think>\n\n</think>\n\nSee you.<|im_end|>"],
    "gemma-3-it": ["Hello!<end_of_turn>", "See you.<end_of_turn>"],
    "chatml-generation": ["Hello!<|im_end|>", "See you.<|im_end|>"],
}

pytestmark = pytest.mark.usefixtures("cache")  # a data cache of its own


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Each template's directory with a tokenizer that knows its special tokens."""
    from tokenizers import AddedToken, Tokenizer

    root = tmp_path_factory.mktemp("chat-checkpoints")
    tokenizer = Tokenizer.from_file(str(TOKENIZER))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL])
    made = {}
    for name in REPLIES:
        directory = root / name
        shutil.copytree(TEMPLATES / name, directory)
        tokenizer.save(str(directory / "tokenizer.json"))
        if name in END_OF_TURN:
            ids = [tokenizer.token_to_id(t) for t in END_OF_TURN[name]]
            (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
        made[name] = directory
    return made


def conversations(count: int) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(count)
    ]


def trained_runs(encoder: Encoder, ids: np.ndarray, trained: np.ndarray) -> list[str]:
    """The text of each run of tokens that carry loss."""
    runs, run = [], []
    for token, on in zip([*ids.tolist(), 0], [*trained.tolist(), 0], strict=True):
        if on:
            run.append(token)
        elif run:
            runs.append(encoder.tokenizer.decode(run, skip_special_tokens=False))
            run = []
    return runs


def row(splits, index: int = 0, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
    source = getattr(splits, split)
    encoded, at = source.encoded, source.rows[index]
    start, end = encoded.starts[at], encoded.starts[at + 1]
    return encoded.ids[start:end], encoded.trained[start:end]


@pytest.mark.parametrize("name", list(REPLIES))
def test_the_replies_carry_loss_and_nothing_else(name, checkpoints):
    encoder = Encoder.load(checkpoints[name], load_tokenizer(checkpoints[name]), "assistant")
    ids, trained = encoder.encode(conversation({"messages": TWO_TURNS}, Columns(), DEFAULT_ROLES))
    text = encoder.template.render(TWO_TURNS, add_generation_prompt=False)
    assert encoder.tokenizer.decode(ids.tolist(), skip_special_tokens=False) == text
    assert trained_runs(encoder, ids, trained) == REPLIES[name]
    # The last template token before each reply (the turn's opening) carries none.
    first = [i for i in range(len(trained)) if trained[i] and not trained[i - 1]]
    assert all(not trained[i - 1] for i in first) and len(first) == 2


PRETRAINED = ROOT / "tests" / "fixtures" / "pretrained"
FAMILY_MASKS = {
    "llama3-chat": [(132, 138), (184, 199)],
    "qwen25-chat": [(74, 80), (124, 139)],
    "qwen3-chat": [(74, 80), (124, 145)],
    "gemma3-chat": [(73, 79), (122, 140)],
}
"""The positions, [start, end), of the tokens that carry loss in the two-turn conversation of
each chat fixture's `chat_reference.json`: its two replies, each from its first token to its
end-of-turn token."""


@pytest.mark.parametrize("name", list(FAMILY_MASKS))
def test_each_familys_two_turn_conversation_trains_exactly_its_replies(name):
    directory = PRETRAINED / name
    reference = json.loads((directory / "chat_reference.json").read_text(encoding="utf-8"))
    two_turn = reference["conversations"]["two-turn"]
    encoder = Encoder.load(directory, load_tokenizer(directory), "assistant")
    row = conversation({"messages": two_turn["full_messages"]}, Columns(), DEFAULT_ROLES)
    ids, trained = encoder.encode(row)
    assert ids.tolist() == two_turn["full_ids"]  # what transformers tokenises
    expected = np.zeros(len(ids), np.uint8)
    for start, end in FAMILY_MASKS[name]:
        expected[start:end] = 1
    np.testing.assert_array_equal(trained, expected)
    # Each reply starts where transformers' prompt for it (with the generation prompt) ends,
    # and ends with the checkpoint's end-of-turn token.
    first_prompt = reference["conversations"]["system-user"]["prompt_ids"]
    starts = [len(first_prompt), len(two_turn["prompt_ids"])]
    assert [start for start, _ in FAMILY_MASKS[name]] == starts
    assert {int(ids[end - 1]) for _, end in FAMILY_MASKS[name]} == {reference["end_of_turn"]["id"]}
    replies = [m["content"] for m in two_turn["full_messages"] if m["role"] == "assistant"]
    assert [r.split("\n")[-1] for r in trained_runs(encoder, ids, trained)] == [
        f"{reply}{reference['end_of_turn']['token']}" for reply in replies
    ]


@pytest.mark.parametrize("name", ["qwen2.5-instruct", "chatml-generation"])
@pytest.mark.parametrize(
    ("loss_on", "replies"),
    [("completion", ["See you.<|im_end|>"]), ("all", None)],
)
def test_loss_on_the_last_reply_or_everything(name, loss_on, replies, checkpoints):
    directory = checkpoints[name]
    encoder = Encoder.load(directory, load_tokenizer(directory), loss_on)
    ids, trained = encoder.encode(conversation({"messages": TWO_TURNS}, Columns(), DEFAULT_ROLES))
    if replies is None:
        assert trained.all()
    else:
        assert trained_runs(encoder, ids, trained) == replies


@pytest.mark.parametrize("name", ["qwen2.5-instruct", "chatml-generation"])
def test_a_prompt_and_completion_trains_the_completion(name, checkpoints, tmp_path):
    rows = [{"prompt": "2+2?", "completion": "4"}] * 3
    splits = zoo.load_data(
        "chat",
        path=str(write_jsonl(tmp_path / "pairs.jsonl", rows)),
        tokenizer=str(checkpoints[name]),
    )
    ids, trained = row(splits)
    encoder = Encoder.load(checkpoints[name], splits.tokenizer, "assistant")
    assert trained_runs(encoder, ids, trained) == ["4<|im_end|>"]
    text = splits.tokenizer.decode(ids.tolist(), skip_special_tokens=False)
    assert "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>" in text


BAD_ROWS = [
    {"messages": []},
    {"messages": [{"content": "who?"}, {"role": "assistant", "content": "a"}]},
    {"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "a"}]},
    {"messages": [{"role": "user", "content": "no reply"}]},
    {"text": "neither column"},
]
REASONS = [
    (2, "has an empty conversation"),
    (3, "has 'messages'[0] without a role"),
    (4, "has 'messages'[0] with the role 'narrator', not one of system, user, assistant, tool"),
    (5, "has no assistant message to train on"),
    (6, "has neither 'messages', or 'prompt' and 'completion'"),
    (7, "is not JSON"),
]
"""The line of each bad row, and what a message says of it."""


@pytest.fixture
def with_bad_rows(tmp_path) -> Path:
    file = write_jsonl(tmp_path / "bad.jsonl", [*conversations(1), *BAD_ROWS])
    with open(file, "a") as f:
        f.write("{not json\n")
        f.writelines(json.dumps(r) + "\n" for r in conversations(6))
    return file


def test_bad_rows_are_named_and_skipped(with_bad_rows, checkpoints, caplog):
    with caplog.at_level(logging.WARNING, logger="zoo"):
        splits = zoo.load_data("chat", path=str(with_bad_rows), tokenizer=str(checkpoints["qwen3"]))
    warned = [r.getMessage() for r in caplog.records]
    for line, reason in REASONS:
        assert sum(f"Skipping {with_bad_rows}:{line}: it {reason}" in w for w in warned) == 1
    assert f"Skipped 6 of the 13 rows of data.path={with_bad_rows}" in warned[-1]
    assert len(splits.train) + len(splits.eval) == 7


def test_bad_rows_are_refused_by_name(with_bad_rows, checkpoints):
    with pytest.raises(ZooError) as refused:
        zoo.load_data(
            "chat", path=str(with_bad_rows), tokenizer=str(checkpoints["qwen3"]), on_error="raise"
        )
    message = str(refused.value)
    assert "6 of the 13 rows" in message and "data.on_error=raise" in message
    assert all(f"{with_bad_rows}:{line} {reason}" in message for line, reason in REASONS)


def test_a_file_without_the_columns_is_refused_and_columns_are_named(tmp_path, checkpoints):
    rows = [{"conversations": r["messages"]} for r in conversations(4)]
    file = write_jsonl(tmp_path / "other.jsonl", rows)
    with pytest.raises(ZooError, match=r"holds no column data=chat reads.*'conversations'"):
        zoo.load_data("chat", path=str(file), tokenizer=str(checkpoints["qwen3"]))
    named = zoo.load_data(
        "chat", path=str(file), tokenizer=str(checkpoints["qwen3"]), messages="conversations"
    )
    assert len(named.train) + len(named.eval) == 4


def test_parquet_folders_and_jsonl_give_the_same_tokens(tmp_path, checkpoints):
    rows = [{"messages": TWO_TURNS}, *conversations(9)]
    folder = tmp_path / "folder"
    (folder / "more").mkdir(parents=True)
    write_jsonl(folder / "a.jsonl", rows[:5])
    pq.write_table(pa.Table.from_pylist(rows[5:]), folder / "more" / "b.parquet")
    single = write_jsonl(tmp_path / "all.jsonl", rows)
    tokenizer = str(checkpoints["llama-3.1-instruct"])
    from_folder, from_file = (
        zoo.load_data("chat", path=str(folder), tokenizer=tokenizer),
        zoo.load_data("chat", path=str(single), tokenizer=tokenizer),
    )

    def all_rows(splits):
        return sorted(
            (tuple(ids.tolist()), tuple(trained.tolist()))
            for split in ("train", "eval")
            for ids, trained in (row(splits, i, split) for i in range(len(getattr(splits, split))))
        )

    assert all_rows(from_folder) == all_rows(from_file)
    assert len(all_rows(from_file)) == 10


def test_held_out_rows_and_val_folders(tmp_path, checkpoints):
    tokenizer = str(checkpoints["qwen3"])
    file = write_jsonl(tmp_path / "c.jsonl", conversations(40))
    splits = zoo.load_data("chat", path=str(file), tokenizer=tokenizer, eval_fraction=0.25)
    held = {splits.eval.encoded.wheres[r] for r in splits.eval.rows}
    trained = {splits.train.encoded.wheres[r] for r in splits.train.rows}
    assert not held & trained and len(held | trained) == 40 and 3 <= len(held) <= 18
    again = zoo.load_data("chat", path=str(file), tokenizer=tokenizer, eval_fraction=0.25)
    assert {again.eval.encoded.wheres[r] for r in again.eval.rows} == held
    for split, count in (("train", 5), ("val", 2)):
        (tmp_path / "split" / split).mkdir(parents=True)
        write_jsonl(tmp_path / "split" / split / "x.jsonl", conversations(count))
    splits = zoo.load_data("chat", path=str(tmp_path / "split"), tokenizer=tokenizer)
    assert (len(splits.train), len(splits.eval)) == (5, 2)


def test_the_split_is_the_same_wherever_the_data_lies(tmp_path, checkpoints, monkeypatch):
    tokenizer = str(checkpoints["qwen3"])

    def held_lines(path: str) -> set[str]:
        splits = zoo.load_data("chat", path=path, tokenizer=tokenizer, eval_fraction=0.25)
        return {splits.eval.encoded.wheres[r].rsplit(":", 1)[1] for r in splits.eval.rows}

    (tmp_path / "a").mkdir()
    write_jsonl(tmp_path / "a" / "c.jsonl", conversations(40))
    held = held_lines(str(tmp_path / "a" / "c.jsonl"))
    monkeypatch.chdir(tmp_path)
    assert held_lines("a/c.jsonl") == held
    (tmp_path / "b" / "deeper").mkdir(parents=True)
    shutil.move(tmp_path / "a" / "c.jsonl", tmp_path / "b" / "deeper" / "c.jsonl")
    assert held_lines(str(tmp_path / "b" / "deeper" / "c.jsonl")) == held
    # In a folder, a row is named by its file's path within data.path.
    assert held_lines(str(tmp_path / "b")) != held
    assert held_lines("b") == held_lines(str(tmp_path / "b"))


def test_tokenised_once_and_cached(tmp_path, checkpoints, cache, monkeypatch):
    file = write_jsonl(tmp_path / "c.jsonl", conversations(5))
    tokenizer = str(checkpoints["qwen3"])
    first = zoo.load_data("chat", path=str(file), tokenizer=tokenizer)
    assert len(list((cache / "chat").glob("*.npz"))) == 1

    def never(*_):
        raise AssertionError("rendered again")

    monkeypatch.setattr(Encoder, "encode", never)
    again = zoo.load_data("chat", path=str(file), tokenizer=tokenizer)
    np.testing.assert_array_equal(again.train.encoded.ids, first.train.encoded.ids)
    with pytest.raises(AssertionError, match="rendered again"):  # another loss_on: a new entry
        zoo.load_data("chat", path=str(file), tokenizer=tokenizer, loss_on="all")


def test_batches_are_padded_to_a_bucket_with_the_mask(tmp_path, checkpoints):
    file = write_jsonl(tmp_path / "c.jsonl", conversations(8))
    splits = zoo.load_data(
        "chat", path=str(file), tokenizer=str(checkpoints["qwen3"]), buckets=[16, 64, 128]
    )
    batch = splits.train.examples(np.arange(2), None, 0)
    shaped = {**batch, **splits.transform(batch)}
    assert shaped["tokens"].shape == (2, 65) and shaped["loss_mask"].shape == (2, 64)
    for i in range(2):
        ids, trained = row(splits, i)
        n = len(ids)
        assert shaped["length"][i] == n - 1
        np.testing.assert_array_equal(shaped["tokens"][i, :n], ids)
        np.testing.assert_array_equal(shaped["loss_mask"][i, : n - 1], trained[1:])
        assert not shaped["loss_mask"][i, n - 1 :].any()


def test_replies_cut_off_by_the_longest_bucket_are_skipped(tmp_path, checkpoints, caplog):
    rows = [
        {
            "messages": [
                {"role": "user", "content": "x" * 200},
                {"role": "assistant", "content": "a"},
            ]
        }
    ]
    # The split draws by "c.jsonl:<line>": line 1 is held out, the long row (line 7) trains.
    file = write_jsonl(tmp_path / "c.jsonl", conversations(6) + rows)
    with caplog.at_level(logging.WARNING, logger="zoo"):
        splits = zoo.load_data(
            "chat", path=str(file), tokenizer=str(checkpoints["qwen3"]), buckets=[64]
        )
    assert len(splits.train) + len(splits.eval) == 6
    assert any(
        "no token that carries loss is among their first 65" in r.getMessage()
        for r in caplog.records
    )


class Logits(nnx.Module):
    """A model whose next-token logits are given."""

    vocab_size = 5

    def __init__(self, logits: np.ndarray):
        self.logits = jax.numpy.asarray(logits)

    def __call__(self, inputs, rngs=None):
        return self.logits


def test_the_language_model_loss_counts_the_masked_targets_only():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 4, 5)).astype(np.float32)
    tokens = rng.integers(0, 5, size=(2, 5))
    mask = np.array([[0, 1, 1, 0], [1, 0, 0, 1]], np.uint8)
    length = np.array([4, 3], np.int32)  # the second row's last target is padding
    batch = {"tokens": tokens, "length": length, "loss_mask": mask}
    loss, metrics = language_model_loss(Logits(logits), batch, nnx.Rngs(0))
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    nll = -np.take_along_axis(np.asarray(log_probs), tokens[:, 1:, None], axis=-1)[..., 0]
    np.testing.assert_allclose(loss, [nll[0, 1:3].mean(), nll[1, 0]], rtol=1e-6)
    np.testing.assert_array_equal(metrics["weight"], [2, 1])
    np.testing.assert_array_equal(metrics["loss_tokens"], [3, 3])
    _, unmasked = language_model_loss(Logits(logits), {"tokens": tokens, "length": length}, None)
    assert "loss_tokens" not in unmasked and unmasked["weight"].tolist() == [4, 3]


def test_bad_parquet_rows_are_named_by_row(tmp_path, checkpoints):
    rows = [*conversations(4), {"messages": [{"role": "", "content": "x"}]}, *conversations(2)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    with pytest.raises(ZooError, match=r"c\.parquet row 4 has 'messages'\[0\] without a role"):
        zoo.load_data(
            "chat",
            path=str(tmp_path / "c.parquet"),
            tokenizer=str(checkpoints["qwen3"]),
            on_error="raise",
        )

"""`data=prompts`: prompts for reward fine-tuning from JSON Lines and Parquet files (text or
messages), rendered with the tiny Qwen 2.5 chat checkpoint's real template and the opening of
the assistant's turn; each row's other columns kept as records that a batch's `row` indexes;
batches padded to a bucket by the pipelines the trainer builds; bad rows named, skipped or
refused; held out by row name as data=chat holds rows out."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import ROOT, write_jsonl
from zoo.data.chat_tokens import Encoder
from zoo.engine.errors import ZooError
from zoo.engine.pipeline import batches as pipeline

import zoo

CHECKPOINT = ROOT / "tests" / "fixtures" / "pretrained" / "qwen25-chat"
SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
"""The system turn Qwen 2.5's template writes when a prompt has none."""

pytestmark = pytest.mark.usefixtures("cache")  # a data cache of its own


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


FEW_SHOT = [
    {"role": "system", "content": "Answer with a number."},
    user("1+1?"),
    assistant("2"),
    user("2+3?"),
]
JSONL = [
    {"prompt": "What is 5+5?", "answer": "10", "level": 1},
    {"prompt": FEW_SHOT, "answer": "5", "tags": ["sum", "few-shot"]},
    {"prompt": [user("Look it up."), {"role": "tool", "content": "42"}], "answer": 42},
]
PARQUET = [
    {"prompt": f"What is {i}*3?", "answer": i * 3, "tags": ["product"], "meta": {"id": i}}
    for i in range(4)
]
CONVERSATIONAL_PARQUET = [
    {"prompt": [user(f"Name {i} primes.")], "solution": [2, 3]} for i in range(3)
]


def questions(count: int, start: int = 0) -> list[dict]:
    return [{"prompt": f"q{i}?", "answer": str(i)} for i in range(start, count)]


def ids_of(encoder: Encoder, messages: list[dict]) -> list[int]:
    text = encoder.render(messages, add_generation_prompt=True)
    return encoder.tokenizer.encode(text, add_special_tokens=False).ids


def examples(splits, split: str) -> list[tuple[dict, np.ndarray]]:
    """Each example of a split (its columns, made by the split's source) with its record."""
    source = getattr(splits, split)
    batch = source.examples(np.arange(len(source)), None, 0)
    records = splits.records[split]
    assert len(records) == len(source) and batch["row"].tolist() == list(range(len(source)))
    return [({c: v[i] for c, v in batch.items()}, records[r]) for i, r in enumerate(batch["row"])]


@pytest.fixture
def folder(tmp_path) -> Path:
    """A folder of the formats: text and messages in JSON Lines, text and messages in Parquet."""
    folder = tmp_path / "prompts"
    write_jsonl(folder / "a.jsonl", JSONL)
    pq.write_table(pa.Table.from_pylist(PARQUET), folder / "b.parquet")
    pq.write_table(pa.Table.from_pylist(CONVERSATIONAL_PARQUET), folder / "c.parquet")
    return folder


def test_prompts_are_the_template_with_the_generation_prompt_and_records_keep_the_columns(
    folder, encoder
):
    splits = zoo.load_data("prompts", path=str(folder), tokenizer=str(CHECKPOINT), buckets=[256])
    found = {}
    for split in ("train", "eval"):
        for example, record in examples(splits, split):
            found[Path(record["where"]).name] = (example, record)
    rows = {
        **{f"a.jsonl:{i}": r for i, r in enumerate(JSONL, 1)},
        **{f"b.parquet row {i}": r for i, r in enumerate(PARQUET)},
        **{f"c.parquet row {i}": r for i, r in enumerate(CONVERSATIONAL_PARQUET)},
    }
    assert sorted(found) == sorted(rows)
    for name, row in rows.items():
        example, record = found[name]
        # The record is the row as the file holds it (other columns and the prompt as given),
        # and its name.
        assert record == {**row, "where": str(folder / name)}
        prompt = row["prompt"]
        messages = [user(prompt)] if isinstance(prompt, str) else prompt
        ids = ids_of(encoder, messages)
        length = int(example["length"])
        assert example["tokens"].shape == (256,) and example["tokens"].dtype == np.int32
        assert example["tokens"][:length].tolist() == ids and not example["tokens"][length:].any()
    text = found["a.jsonl:1"][0]
    shown = encoder.tokenizer.decode(
        text["tokens"][: text["length"]].tolist(), skip_special_tokens=False
    )
    assert shown == f"{SYSTEM}<|im_end|>\n<|im_start|>user\nWhat is 5+5?<|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )


def test_batches_are_padded_to_the_bucket_of_their_longest_prompt(tmp_path, encoder):
    """Buckets of 80, 96 and 128 tokens: a short prompt (78 tokens) fits 80, a longer one (95)
    96; a batch is padded to its longest, and `row` finds each one's record."""
    short, longer = {"prompt": "Hi", "answer": "a"}, {"prompt": "word " * 6, "answer": "b"}
    write_jsonl(tmp_path / "val" / "held.jsonl", [short, longer])
    write_jsonl(tmp_path / "train" / "p.jsonl", [short, longer, short, longer])
    splits = zoo.load_data(
        "prompts", path=str(tmp_path), tokenizer=str(CHECKPOINT), buckets=[96, 128, 80]
    )
    shapes = [
        b["tokens"].shape for b in pipeline.eval_batches(splits.eval, 1, transform=splits.transform)
    ]
    assert shapes == [(1, 80), (1, 96)]
    train, held_out = pipeline.process_pipelines(splits, batch_size=3, seed=0)
    iterator = iter(train)
    for _ in range(3):
        batch = next(iterator)
        assert batch["tokens"].shape == (3, 96)
        assert {c: batch[c].dtype for c in ("tokens", "length", "row")} == dict.fromkeys(
            ("tokens", "length", "row"), np.int32
        )
        for tokens, length, row in zip(batch["tokens"], batch["length"], batch["row"]):
            record = splits.records["train"][row]
            assert tokens[:length].tolist() == ids_of(encoder, [user(record["prompt"])])
            assert not tokens[length:].any()
    (batch,) = list(pipeline.eval_batches(splits.eval, 4, transform=splits.transform))
    assert batch["tokens"].shape == (4, 96) and batch["mask"].tolist() == [1, 1, 0, 0]
    assert [splits.records["eval"][r]["answer"] for r in batch["row"][:2]] == ["a", "b"]
    (batch,) = list(held_out)
    assert batch["mask"].tolist() == [1, 1, 0]


REFUSING = (
    "{%- for m in messages %}{%- if m.role == 'narrator' %}"
    "{{ raise_exception('This template has no narrator.') }}{%- endif %}{%- endfor %}"
)
"""The opening of a chat template that refuses one role of `data.roles`."""
BAD_ROWS = [
    ({"question": "2+2?", "answer": "4"}, "has no 'prompt'"),
    ({"prompt": "", "answer": "4"}, "has an empty 'prompt'"),
    ({"prompt": []}, "has an empty conversation ('prompt' is [])"),
    (
        {"prompt": [{"role": "critic", "content": "x"}]},
        "has 'prompt'[0] with the role 'critic', not one of system, user, assistant, tool, narrator",
    ),
    (
        {"prompt": [{"role": "narrator", "content": "x"}, user("p")]},
        "The chat template refused the conversation: This template has no narrator.",
    ),
    (
        {"prompt": [user("Hi"), assistant("Hello!")]},
        "has a 'prompt' whose last message is the assistant's",
    ),
    ({"prompt": "p", "where": "here"}, "has a column 'where', which its record"),
    ({"prompt": "word " * 100}, "is 377 tokens long, longer than the largest bucket (128 of"),
    (["p"], "is a list, not an object of columns"),
]
"""Rows that are no prompt, and what a message says of each."""


@pytest.fixture
def with_bad_rows(tmp_path) -> dict:
    """The data keys of a file of good and bad rows (lines 2 to 10 bad, line 11 not JSON),
    rendered by Qwen 2.5's template opened with `REFUSING`."""
    template = tmp_path / "template"
    template.mkdir()
    config = json.loads((CHECKPOINT / "tokenizer_config.json").read_text())
    (template / "tokenizer_config.json").write_text(json.dumps(config))
    (template / "chat_template.jinja").write_text(REFUSING + config["chat_template"])
    file = write_jsonl(tmp_path / "bad.jsonl", [*questions(1), *(row for row, _ in BAD_ROWS)])
    with open(file, "a") as f:
        f.write("{not json\n")
        f.writelines(json.dumps(r) + "\n" for r in questions(7, 1))
    return {
        "path": str(file),
        "tokenizer": str(CHECKPOINT),
        "template": str(template),
        "roles": ["system", "user", "assistant", "tool", "narrator"],
        "buckets": [128],
    }


def reasons(file: str) -> list[str]:
    """Each bad row's name and what is said of it."""
    named = [f"{file}:{line} {reason}" for line, (_, reason) in enumerate(BAD_ROWS, 2)]
    return [*named, f"{file}:{len(BAD_ROWS) + 2} is not JSON"]


def test_bad_rows_are_named_and_skipped(with_bad_rows, caplog):
    with caplog.at_level(logging.WARNING, logger="zoo"):
        splits = zoo.load_data("prompts", **with_bad_rows)
    warned = [r.getMessage() for r in caplog.records]
    for reason in reasons(with_bad_rows["path"]):
        where, said = reason.split(" ", 1)
        assert sum(f"Skipping {where}: it {said}" in w for w in warned) == 1, reason
    assert f"Skipped 10 of the 17 rows of data.path={with_bad_rows['path']}" in warned[-1]
    records = [*splits.records["train"], *splits.records["eval"]]
    assert sorted(r["answer"] for r in records) == [str(i) for i in range(7)]


def test_bad_rows_are_refused_by_name(with_bad_rows):
    with pytest.raises(ZooError) as refused:
        zoo.load_data("prompts", **with_bad_rows, on_error="raise")
    message = str(refused.value)
    assert "10 of the 17 rows" in message and "no prompt to train on" in message
    assert all(reason in message for reason in reasons(with_bad_rows["path"]))


def test_held_out_rows_by_name_as_chat_holds_them_out(tmp_path):
    file = write_jsonl(tmp_path / "a" / "p.jsonl", questions(40))
    splits = zoo.load_data("prompts", path=str(file), tokenizer=str(CHECKPOINT), eval_fraction=0.25)
    held = {Path(r["where"]).name for r in splits.records["eval"]}
    trained = {Path(r["where"]).name for r in splits.records["train"]}
    assert not held & trained and len(held | trained) == 40 and 3 <= len(held) <= 18
    # A row's name (the file's and its line) draws its side: data=chat's on the same name.
    rows = [{"prompt": r["prompt"], "completion": r["answer"]} for r in questions(40)]
    chats = zoo.load_data(
        "chat",
        path=str(write_jsonl(tmp_path / "b" / "p.jsonl", rows)),
        tokenizer=str(CHECKPOINT),
        eval_fraction=0.25,
    )
    assert held == {Path(chats.eval.encoded.wheres[r]).name for r in chats.eval.rows}
    write_jsonl(tmp_path / "split" / "train" / "x.jsonl", questions(5))
    write_jsonl(tmp_path / "split" / "val" / "x.jsonl", questions(7, 5))
    splits = zoo.load_data("prompts", path=str(tmp_path / "split"), tokenizer=str(CHECKPOINT))
    assert [r["answer"] for r in splits.records["train"]] == ["0", "1", "2", "3", "4"]
    assert [r["answer"] for r in splits.records["eval"]] == ["5", "6"]


def test_held_out_prompts_to_reply_to_end_at_the_end_of_turn(tmp_path, encoder):
    write_jsonl(tmp_path / "train" / "p.jsonl", questions(3))
    write_jsonl(tmp_path / "val" / "p.jsonl", JSONL)
    splits = zoo.load_data(
        "prompts", path=str(tmp_path), tokenizer=str(CHECKPOINT), eval_replies=2, buckets=[128]
    )
    replies = splits.prompts()
    assert len(replies) == 2
    for prompt, row in zip(replies, JSONL):
        messages = [user(row["prompt"])] if isinstance(row["prompt"], str) else row["prompt"]
        assert prompt.ids.tolist() == ids_of(encoder, messages) and prompt.max_new_tokens == 64
        assert prompt.text == encoder.render(messages, add_generation_prompt=True)
        assert encoder.tokenizer.token_to_id("<|im_end|>") in prompt.end_of_turn


def test_tokenised_once_into_the_cache_and_records_read_again(tmp_path, cache, monkeypatch):
    file = write_jsonl(tmp_path / "p.jsonl", [*JSONL, *questions(3)])
    first = zoo.load_data("prompts", path=str(file), tokenizer=str(CHECKPOINT))
    assert len(list((cache / "prompts").glob("*.npz"))) == 1

    def never(*_, **__):
        raise AssertionError("rendered again")

    monkeypatch.setattr(Encoder, "render", never)
    again = zoo.load_data("prompts", path=str(file), tokenizer=str(CHECKPOINT))
    np.testing.assert_array_equal(again.train.encoded.ids, first.train.encoded.ids)
    assert again.records == first.records
    with pytest.raises(AssertionError, match="rendered again"):  # other buckets: a new entry
        zoo.load_data("prompts", path=str(file), tokenizer=str(CHECKPOINT), buckets=[512])

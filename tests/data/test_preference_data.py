"""`data=preference`: preference pairs from JSON Lines and Parquet files (an explicit prompt as
text or messages, or an implicit one that two conversations share), rendered with the tiny Qwen
2.5 chat checkpoint's real template into a chosen and a rejected sequence, each with the mask
`data=chat` gives its reply; bad rows named, skipped or refused; batches padded to a bucket by
the pipelines the trainer builds."""

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
END = "<|im_end|>"

pytestmark = pytest.mark.usefixtures("cache")  # a data cache of its own


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


TEXT = {"prompt": "2+2?", "chosen": "4", "rejected": "5"}
CONVERSATIONAL = {
    "prompt": [{"role": "system", "content": "Be brief."}, user("Name a prime.")],
    "chosen": [assistant("Seven.")],
    "rejected": [assistant("Nine.")],
}
OPENING = [user("Hi"), assistant("Hello!"), user("Bye")]
IMPLICIT = {
    "chosen": [*OPENING, assistant("See you.")],
    "rejected": [*OPENING, assistant("Go away.")],
}
EXPECTED = {
    "a.jsonl:1": ([user("2+2?")], ("4", "5")),
    "a.jsonl:2": (CONVERSATIONAL["prompt"], ("Seven.", "Nine.")),
    "a.jsonl:3": (OPENING, ("See you.", "Go away.")),
}
"""Each format's row (by its name): its prompt's messages, and its chosen and rejected reply."""


def texts(count: int, start: int = 0) -> list[dict]:
    return [{"prompt": f"q{i}?", "chosen": "yes", "rejected": "no"} for i in range(start, count)]


def name(where: str) -> str:
    """A row's name without its folder: `a.jsonl:3`, `b.parquet row 0`."""
    return Path(where).name


def pairs_by_name(splits) -> dict[str, list[tuple[np.ndarray, np.ndarray]]]:
    """Each pair of both splits by its row's name: [(ids, marks) of the chosen, of the
    rejected]."""
    found = {}
    for source in (splits.train, splits.eval):
        for row in source.rows:
            found[name(source.pairs.wheres[row])] = [side.piece(row) for side in source.sides]
    return found


def examples_by_line(source, wheres) -> dict[int, dict[str, np.ndarray]]:
    """Each example of a split by its row's line (`wheres`: the rows' names)."""
    batch = source.examples(np.arange(len(source)), None, 0)
    return {
        int(wheres[row].rsplit(":", 1)[1]): {column: v[i] for column, v in batch.items()}
        for i, row in enumerate(source.rows)
    }


def ids_of(encoder: Encoder, text: str) -> list[int]:
    return encoder.tokenizer.encode(text, add_special_tokens=False).ids


def trained_text(encoder: Encoder, ids: np.ndarray, marks: np.ndarray) -> str:
    return encoder.tokenizer.decode(ids[marks == 1].tolist(), skip_special_tokens=False)


def test_each_format_renders_the_prompt_with_each_reply(tmp_path, encoder):
    folder = tmp_path / "pairs"
    write_jsonl(folder / "a.jsonl", [TEXT, CONVERSATIONAL, {**IMPLICIT, "source": "ignored"}])
    pq.write_table(pa.Table.from_pylist([CONVERSATIONAL, CONVERSATIONAL]), folder / "b.parquet")
    pq.write_table(pa.Table.from_pylist([IMPLICIT, IMPLICIT]), folder / "c.parquet")
    pairs = pairs_by_name(zoo.load_data("preference", path=str(folder), tokenizer=str(CHECKPOINT)))
    assert len(pairs) == 7
    for where, (prompt, replies) in EXPECTED.items():
        asked = len(ids_of(encoder, encoder.render(prompt, add_generation_prompt=True)))
        for (ids, marks), reply in zip(pairs[where], replies, strict=True):
            whole = encoder.render([*prompt, assistant(reply)], add_generation_prompt=False)
            assert ids.tolist() == ids_of(encoder, whole)
            # The reply's tokens carry loss, from its first (right after the prompt and the
            # opening of the assistant's turn) to its end-of-turn token.
            assert not marks[:asked].any() and marks[asked] == 1
            assert trained_text(encoder, ids, marks) == reply + END
        chosen, rejected = pairs[where]
        np.testing.assert_array_equal(chosen[0][:asked], rejected[0][:asked])
    for parquet, jsonl in (("b.parquet row 1", "a.jsonl:2"), ("c.parquet row 0", "a.jsonl:3")):
        for (ids, marks), (same_ids, same_marks) in zip(pairs[parquet], pairs[jsonl]):
            np.testing.assert_array_equal(ids, same_ids)
            np.testing.assert_array_equal(marks, same_marks)


ON = {"tokenizer": str(CHECKPOINT), "buckets": [256]}


def test_the_masks_are_chats_on_the_last_reply(tmp_path):
    rows = [TEXT, CONVERSATIONAL, IMPLICIT, *texts(5)]
    splits = zoo.load_data(
        "preference", path=str(write_jsonl(tmp_path / "p" / "pairs.jsonl", rows)), **ON
    )
    pairs = {
        line: example
        for source in (splits.train, splits.eval)
        for line, example in examples_by_line(source, source.pairs.wheres).items()
    }
    for side, reply in enumerate(("chosen", "rejected")):
        as_chat = [
            {"messages": r[reply]}
            if "prompt" not in r
            else {"prompt": r["prompt"], "completion": r[reply]}
            for r in rows
        ]
        conversations = zoo.load_data(
            "chat",
            path=str(write_jsonl(tmp_path / reply / "pairs.jsonl", as_chat)),
            loss_on="completion",
            **ON,
        )
        for source in (conversations.train, conversations.eval):
            for line, example in examples_by_line(source, source.encoded.wheres).items():
                for column in ("tokens", "length", "loss_mask"):
                    np.testing.assert_array_equal(pairs[line][column][side], example[column])
                assert example["loss_mask"].sum() > 0
    assert sorted(pairs) == list(range(1, 9))


REFUSING = (
    "{%- for m in messages %}{%- if m.role == 'narrator' %}"
    "{{ raise_exception('This template has no narrator.') }}{%- endif %}{%- endfor %}"
)
"""The opening of a chat template that refuses one role of `data.roles`."""
BAD_ROWS = [
    ({"prompt": "p", "rejected": "r"}, "has no 'chosen' reply"),
    ({"prompt": "p", "chosen": "c", "rejected": ""}, "has an empty 'rejected' reply"),
    (
        {"prompt": "p", "chosen": "same", "rejected": "same"},
        "has the same 'chosen' and 'rejected' reply",
    ),
    (
        {"prompt": [{"role": "critic", "content": "x"}], "chosen": "c", "rejected": "r"},
        "has 'prompt'[0] with the role 'critic', not one of system, user, assistant, tool, narrator",
    ),
    (
        {
            "prompt": [{"role": "narrator", "content": "x"}, user("p")],
            "chosen": "c",
            "rejected": "r",
        },
        "The chat template refused the conversation: This template has no narrator.",
    ),
    (
        {"chosen": [user("a"), assistant("c")], "rejected": [user("b"), assistant("r")]},
        "has no 'prompt' and no prompt that 'chosen' and 'rejected' share",
    ),
    (
        {"chosen": [*OPENING, assistant("c")], "rejected": [user("Hi"), assistant("Hey")]},
        "has 'chosen' and 'rejected' that differ at message 1, before a 'user' message",
    ),
    ({"prompt": "p", "chosen": [user("c")], "rejected": "r"}, "has a 'chosen' reply with a 'user'"),
]
"""Rows that are no pair to train on, and what a message says of each."""


@pytest.fixture
def with_bad_rows(tmp_path) -> dict:
    """The data keys of a file of good and bad rows (lines 2 to 9 bad, line 10 not JSON),
    rendered by Qwen 2.5's template opened with `REFUSING`."""
    template = tmp_path / "template"
    template.mkdir()
    config = json.loads((CHECKPOINT / "tokenizer_config.json").read_text())
    (template / "tokenizer_config.json").write_text(json.dumps(config))
    (template / "chat_template.jinja").write_text(REFUSING + config["chat_template"])
    file = write_jsonl(tmp_path / "bad.jsonl", [*texts(1), *(row for row, _ in BAD_ROWS)])
    with open(file, "a") as f:
        f.write("{not json\n")
        f.writelines(json.dumps(r) + "\n" for r in texts(7, 1))
    roles = ["system", "user", "assistant", "tool", "narrator"]
    return {
        "path": str(file),
        "tokenizer": str(CHECKPOINT),
        "template": str(template),
        "roles": roles,
    }


def reasons(file: str) -> list[str]:
    """Each bad row's name and what is said of it."""
    named = [f"{file}:{line} {reason}" for line, (_, reason) in enumerate(BAD_ROWS, 2)]
    return [*named, f"{file}:{len(BAD_ROWS) + 2} is not JSON"]


def test_bad_rows_are_named_and_skipped(with_bad_rows, caplog):
    with caplog.at_level(logging.WARNING, logger="zoo"):
        splits = zoo.load_data("preference", **with_bad_rows)
    warned = [r.getMessage() for r in caplog.records]
    for reason in reasons(with_bad_rows["path"]):
        where, said = reason.split(" ", 1)
        assert sum(f"Skipping {where}: it {said}" in w for w in warned) == 1, reason
    assert f"Skipped 9 of the 16 rows of data.path={with_bad_rows['path']}" in warned[-1]
    assert len(splits.train) + len(splits.eval) == 7


def test_bad_rows_are_refused_by_name(with_bad_rows):
    with pytest.raises(ZooError) as refused:
        zoo.load_data("preference", **with_bad_rows, on_error="raise")
    message = str(refused.value)
    assert "9 of the 16 rows" in message and "no preference pair to train on" in message
    assert all(reason in message for reason in reasons(with_bad_rows["path"]))


def test_batches_are_padded_to_the_bucket_of_either_sides_longest(tmp_path, caplog):
    """Buckets of 96, 160 and 256 tokens: a short pair (about 84 tokens a side) fits 96, a
    pair whose rejected reply is longer (143) 160; one longer than 256 is cut to it, and one
    whose prompt alone fills 256 is skipped."""
    short, longer = TEXT, {**TEXT, "rejected": "word " * 20}
    cut = {**TEXT, "rejected": "word " * 60}
    write_jsonl(tmp_path / "val" / "held.jsonl", [short, longer])
    write_jsonl(tmp_path / "train" / "p.jsonl", [short, cut, {**TEXT, "prompt": "word " * 60}])
    with caplog.at_level(logging.WARNING, logger="zoo"):
        splits = zoo.load_data(
            "preference", path=str(tmp_path), tokenizer=str(CHECKPOINT), buckets=[160, 96, 256]
        )
    assert "Skipped 1 of the 3 training preference pairs" in caplog.text
    assert f"{tmp_path / 'train' / 'p.jsonl'}:3" in caplog.text
    # One pair a batch: each is padded to its own bucket.
    shapes = [
        b["tokens"].shape for b in pipeline.eval_batches(splits.eval, 1, transform=splits.transform)
    ]
    assert shapes == [(1, 2, 97), (1, 2, 161)]
    train, held_out = pipeline.process_pipelines(splits, batch_size=2, seed=0)
    batch = next(iter(train))
    assert batch["tokens"].shape == (2, 2, 257) and batch["loss_mask"].shape == (2, 2, 256)
    assert batch["length"].dtype == np.int32 and batch["loss_mask"].dtype == np.uint8
    which = int(np.argmax(batch["length"][:, 1]))  # the cut pair: its rejected side fills 256
    assert batch["length"][which].tolist()[1] == 256 and batch["loss_mask"][which, 1, -1] == 1
    (batch,) = list(held_out)
    assert batch["tokens"].shape == (2, 2, 161) and batch["mask"].tolist() == [1, 1]
    ids, marks = pairs_by_name(splits)["held.jsonl:2"][1]  # the longer rejected reply
    n = len(ids)
    np.testing.assert_array_equal(batch["tokens"][1, 1, :n], ids)
    assert not batch["tokens"][1, 1, n:].any() and batch["length"][1, 1] == n - 1
    np.testing.assert_array_equal(batch["loss_mask"][1, 1, : n - 1], marks[1:])
    assert not batch["loss_mask"][1, :, n - 1 :].any()


def test_packing_puts_each_pair_in_the_same_segment_of_both_rows(tmp_path):
    """`data.packing=true`: the training pairs (of replies of 1 to 12 words, about 85 to 110
    tokens a side) several to an example of 384 targets; pair k of an example is segment k of
    its chosen row and of its rejected row, each the pair's sequence with its own positions and
    its reply's loss mask (its last target cleared); `pair_slots` marks the slots used; every
    pair is in one example; the held-out pairs stay one to an example."""
    rows = [
        {"prompt": f"q{i}?", "chosen": "yes " * (1 + i % 12), "rejected": "no " * (1 + i * 5 % 12)}
        for i in range(24)
    ]
    write_jsonl(tmp_path / "train" / "p.jsonl", rows)
    write_jsonl(tmp_path / "val" / "held.jsonl", texts(3))
    splits = zoo.load_data(
        "preference", path=str(tmp_path), tokenizer=str(CHECKPOINT), buckets=[384], packing=True
    )
    pieces = pairs_by_name(splits)
    train = splits.train
    batch = train.examples(np.arange(len(train)), None, 0)
    slots = batch["pair_slots"]
    assert len(train) <= 24 // 3 and slots.shape[1] >= 3
    assert all(np.all(np.diff(row.astype(int)) <= 0) for row in slots)
    assert batch["tokens"].shape == (len(train), 2, 385)
    assert "segment_ids" not in splits.eval.examples(np.arange(3), None, 0)
    seen = []
    for example, held in enumerate(train.packs):
        assert slots[example].sum() == len(held)
        for slot, pair in enumerate(held, start=1):
            where = name(train.pairs.wheres[train.rows[pair]])
            seen.append(where)
            for side, (ids, marks) in enumerate(pieces[where]):
                segment = batch["segment_ids"][example, side] == slot  # its inputs
                n, start = int(segment.sum()), int(np.argmax(segment))
                assert n == len(ids) - (start + len(ids) == 385)
                row = batch["tokens"][example, side]
                np.testing.assert_array_equal(row[start : start + len(ids)], ids)
                np.testing.assert_array_equal(
                    batch["positions"][example, side][segment], np.arange(n)
                )
                trained = batch["loss_mask"][example, side][start : start + len(ids) - 1]
                np.testing.assert_array_equal(trained, marks[1:])
    assert sorted(seen) == sorted(f"p.jsonl:{i}" for i in range(1, 25))
    train_batches, _ = pipeline.process_pipelines(splits, batch_size=2, seed=0)
    first = next(iter(train_batches))
    assert first["pair_slots"].shape == (2, slots.shape[1])
    assert first["segment_ids"].shape == first["loss_mask"].shape == (2, 2, 384)


def test_held_out_rows_by_name_as_chat_holds_them_out(tmp_path):
    file = write_jsonl(tmp_path / "a" / "p.jsonl", texts(40))
    splits = zoo.load_data(
        "preference", path=str(file), tokenizer=str(CHECKPOINT), eval_fraction=0.25
    )
    held = {splits.eval.pairs.wheres[r] for r in splits.eval.rows}
    trained = {splits.train.pairs.wheres[r] for r in splits.train.rows}
    assert not held & trained and len(held | trained) == 40 and 3 <= len(held) <= 18
    # A row's name (the file's and its line) draws its side: data=chat's on the same name.
    rows = [{"prompt": r["prompt"], "completion": r["chosen"]} for r in texts(40)]
    chats = zoo.load_data(
        "chat",
        path=str(write_jsonl(tmp_path / "b" / "p.jsonl", rows)),
        tokenizer=str(CHECKPOINT),
        eval_fraction=0.25,
    )
    assert {name(w) for w in held} == {name(chats.eval.encoded.wheres[r]) for r in chats.eval.rows}
    write_jsonl(tmp_path / "split" / "train" / "x.jsonl", texts(5))
    write_jsonl(tmp_path / "split" / "val" / "x.jsonl", texts(2))
    splits = zoo.load_data("preference", path=str(tmp_path / "split"), tokenizer=str(CHECKPOINT))
    assert (len(splits.train), len(splits.eval)) == (5, 2)


def test_held_out_prompts_are_asked_and_answered_with_the_chosen_reply(tmp_path, encoder):
    write_jsonl(tmp_path / "train" / "p.jsonl", texts(3))
    write_jsonl(tmp_path / "val" / "p.jsonl", [CONVERSATIONAL, IMPLICIT, TEXT])
    splits = zoo.load_data(
        "preference",
        path=str(tmp_path),
        tokenizer=str(CHECKPOINT),
        eval_replies=2,
        eval_reply_tokens=5,
    )
    prompts = splits.prompts()
    assert [p.reference for p in prompts] == ["Seven.", "See you."]
    for prompt, messages in zip(prompts, (CONVERSATIONAL["prompt"], OPENING), strict=True):
        assert prompt.text == encoder.render(messages, add_generation_prompt=True)
        assert prompt.ids.tolist() == ids_of(encoder, prompt.text) and prompt.max_new_tokens == 5


def test_tokenised_once_into_the_cache(tmp_path, cache, monkeypatch):
    file = write_jsonl(tmp_path / "p.jsonl", [TEXT, IMPLICIT, *texts(3)])
    first = zoo.load_data("preference", path=str(file), tokenizer=str(CHECKPOINT))
    assert len(list((cache / "preference").glob("*.npz"))) == 1

    def never(*_):
        raise AssertionError("rendered again")

    monkeypatch.setattr(Encoder, "encode", never)
    again = zoo.load_data("preference", path=str(file), tokenizer=str(CHECKPOINT))
    for side in ("chosen", "rejected"):
        np.testing.assert_array_equal(
            getattr(again.train.pairs, side).ids, getattr(first.train.pairs, side).ids
        )
    with pytest.raises(AssertionError, match="rendered again"):  # other columns: a new entry
        zoo.load_data("preference", path=str(file), tokenizer=str(CHECKPOINT), prompt="question")

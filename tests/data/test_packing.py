"""`data=chat data.packing=true` (`zoo.data.packing`): conversations packed first-fit decreasing
into rows of the largest bucket, every one exactly once, with segment ids, positions that
restart at each conversation and no loss on a target across a boundary; the same rows on every
run; and a model that cannot take packed rows refused by name before it is built."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from helpers import ROOT, overriding
from zoo.data.packing import first_fit, pack
from zoo.engine.errors import ZooError
from zoo.engine.loop.trainer import Trainer

import zoo

CHECKPOINT = ROOT / "tests" / "fixtures" / "pretrained" / "qwen25-chat"

pytestmark = pytest.mark.usefixtures("cache")  # a data cache of its own


def naive_first_fit(sizes, capacity) -> list[int]:
    """First-fit decreasing, written out: each item into the first row with room."""
    rows, room = [0] * len(sizes), []
    for item in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        row = next((r for r, left in enumerate(room) if left >= sizes[item]), len(room))
        if row == len(room):
            room.append(capacity)
        room[row] -= sizes[item]
        rows[item] = row
    return rows


@pytest.mark.parametrize("count", [1, 2, 7, 300])
def test_first_fit_is_first_fit_decreasing(count):
    sizes = np.random.default_rng(count).integers(1, 65, count)
    rows = first_fit(sizes, 65)
    assert rows.tolist() == naive_first_fit(sizes.tolist(), 65)
    assert np.bincount(rows, weights=sizes).max() <= 65


def test_a_packed_row_restarts_positions_and_trains_no_target_across_conversations():
    pieces = [
        (np.array([5, 6, 7]), np.array([0, 1, 1], np.uint8)),
        (np.array([8, 9]), np.array([1, 1], np.uint8)),  # its first token carries loss
    ]
    batch = pack([pieces, pieces[1:]], 7)
    assert batch["tokens"].tolist() == [[5, 6, 7, 8, 9, 0, 0, 0], [8, 9, 0, 0, 0, 0, 0, 0]]
    assert batch["length"].tolist() == [4, 1]
    assert batch["segment_ids"].tolist() == [[1, 1, 1, 2, 2, 0, 0], [1, 1, 0, 0, 0, 0, 0]]
    assert batch["positions"].tolist() == [[0, 1, 2, 0, 1, 0, 0], [0, 1, 0, 0, 0, 0, 0]]
    # 7 does not predict 8: the targets 6, 7 and 9 carry loss, not 8.
    assert batch["loss_mask"].tolist() == [[1, 1, 0, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0]]


def skewed(count: int) -> list[dict]:
    """Many short conversations and a few long ones."""
    lengths = np.minimum(np.random.default_rng(0).pareto(1.5, count) * 30, 300)
    return [
        {
            "messages": [
                {"role": "user", "content": f"q{i} " + "w " * int(n)},
                {"role": "assistant", "content": f"a{i}"},
            ]
        }
        for i, n in enumerate(lengths)
    ]


@pytest.fixture
def conversations(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in skewed(60)))
    return path


def test_every_training_conversation_is_packed_once(conversations):
    kwargs = {"path": str(conversations), "tokenizer": str(CHECKPOINT), "buckets": [128, 512]}
    plain, packed = zoo.load_data("chat", **kwargs), zoo.load_data("chat", **kwargs, packing=True)
    assert len(packed.train) < len(plain.train) / 3
    assert len(packed.eval) == len(plain.eval)  # held out as it is: evaluated one to a row
    batch = packed.train.examples(np.arange(len(packed.train)), None, 0)
    seen = []
    for tokens, segments, positions, mask, length in zip(
        *(batch[c] for c in ("tokens", "segment_ids", "positions", "loss_mask", "length")),
        strict=True,
    ):
        starts = np.flatnonzero((positions == 0) & (segments > 0))
        for start, end in zip(starts, [*starts[1:], length + 1], strict=True):
            seen.append((tokens[start:end].tolist(), mask[start : end - 1].tolist()))
            assert end - 1 == len(mask) or mask[end - 1] == 0  # no target across conversations
            inputs = min(end, len(positions))  # the row's last token is a target only
            assert positions[start:inputs].tolist() == list(range(inputs - start))
    alone = plain.train.examples(np.arange(len(plain.train)), None, 0)
    expected = sorted(
        (tokens[: n + 1].tolist(), mask[:n].tolist())
        for tokens, mask, n in zip(
            alone["tokens"], alone["loss_mask"], alone["length"], strict=True
        )
    )
    assert sorted(seen) == expected
    # Within one row of the fewest that could hold its tokens (the held-out rows, and so the
    # share of padding, depend on the file's path: 0.885-0.958 non-pad over 40 paths).
    real = int(np.sum(batch["segment_ids"] > 0))
    assert len(packed.train) <= math.ceil(real / 512) + 1
    shaped = packed.transform(batch)
    assert shaped["tokens"].shape[1] - 1 == shaped["segment_ids"].shape[1] == 512
    again = zoo.load_data("chat", **kwargs, packing=True).train.packs  # the same rows on every run
    assert [p.tolist() for p in again] == [p.tolist() for p in packed.train.packs]


def test_a_model_that_cannot_take_packed_rows_is_refused_before_it_is_built(
    conversations, tmp_path
):
    overrides = ["model=gpt", "data=chat", f"data.path={conversations}", "data.packing=true"]
    config = zoo.compose(
        overriding(*overrides, f"data.tokenizer={CHECKPOINT}", f"workdir={tmp_path / 'run'}")
    )
    with pytest.raises(ZooError, match="Model 'gpt' cannot take packed rows.*decoder"):
        Trainer(config)
    assert not (tmp_path / "run").exists()

"""The generic Grain pipelines on real Grain datasets and iterators."""

from __future__ import annotations

import grain
import numpy as np
import pytest
from zoo.engine.pipeline import batches as pipeline
from zoo.engine.registry import get_data

import zoo


def column(n: int) -> dict[str, np.ndarray]:
    return {"index": np.arange(n), "x": np.arange(n, dtype=np.float32)[:, None] * 2}


def take(iterator, k: int) -> list[dict[str, np.ndarray]]:
    return [next(iterator) for _ in range(k)]


def test_train_batches_have_fixed_shapes_and_aligned_columns():
    batches = take(iter(pipeline.train_batches(column(10), batch_size=4, seed=0)), 6)
    for batch in batches:
        assert batch["index"].shape == (4,) and batch["x"].shape == (4, 1)
        np.testing.assert_array_equal(batch["x"][:, 0], batch["index"] * 2)


@pytest.mark.parametrize(("n", "batch_size"), [(10, 4), (2500, 128), (3, 8)])
def test_every_example_once_per_epoch_reshuffled_each_epoch(n, batch_size):
    epochs = 4
    steps = -(-epochs * n // batch_size)
    stream = np.concatenate(
        [b["index"] for b in take(iter(pipeline.train_batches(column(n), batch_size, 7)), steps)]
    )
    orders = [stream[e * n : (e + 1) * n] for e in range(epochs)]
    for order in orders:
        np.testing.assert_array_equal(np.sort(order), np.arange(n))
    if n > 3:
        assert len({tuple(order) for order in orders}) == epochs


def test_order_depends_on_seed_only():
    def first(seed):
        return next(iter(pipeline.train_batches(column(100), 10, seed)))["index"]

    np.testing.assert_array_equal(first(1), first(1))
    assert not np.array_equal(first(1), first(2))


def test_process_shards_partition_the_global_batch():
    global_batches = take(iter(pipeline.train_batches(column(50), 8, 3)), 10)
    shards = [take(iter(pipeline.train_batches(column(50), 8, 3, i, 4)), 10) for i in range(4)]
    for step, batch in enumerate(global_batches):
        joined = np.concatenate([shard[step]["index"] for shard in shards])
        np.testing.assert_array_equal(joined, batch["index"])


def test_iterator_state_restores_the_exact_position():
    dataset = pipeline.train_batches(column(30), 4, seed=5)
    iterator = iter(dataset)
    take(iterator, 11)
    state = iterator.get_state()
    expected = take(iterator, 5)
    resumed = iter(dataset)
    resumed.set_state(state)
    for got, want in zip(take(resumed, 5), expected, strict=True):
        np.testing.assert_array_equal(got["index"], want["index"])


def test_eval_covers_every_example_once_and_masks_the_partial_batch():
    batches = list(pipeline.eval_batches(column(10), batch_size=4))
    assert len(batches) == 3
    assert all(b["index"].shape == (4,) for b in batches)
    np.testing.assert_array_equal(batches[-1][pipeline.MASK], [1, 1, 0, 0])
    real = np.concatenate([b["index"][b[pipeline.MASK] > 0] for b in batches])
    np.testing.assert_array_equal(real, np.arange(10))


def test_a_random_access_source_is_batched_exactly_as_columns():
    """A Grain MapDataset of records (or any __len__ + __getitem__ source) gives the batches
    that the same data as columns gives: same order, shards, epochs and eval masking."""
    columns = column(30)
    records = grain.MapDataset.source([{k: v[i] for k, v in columns.items()} for i in range(30)])
    for shard in range(2):
        from_columns = iter(pipeline.train_batches(columns, 8, 3, shard, 2))
        from_records = iter(pipeline.train_batches(records, 8, 3, shard, 2))
        for got, want in zip(take(from_records, 9), take(from_columns, 9), strict=True):
            assert got.keys() == want.keys()
            for name in want:
                np.testing.assert_array_equal(got[name], want[name])
    from_columns, from_records = (list(pipeline.eval_batches(d, 8)) for d in (columns, records))
    for got, want in zip(from_records, from_columns, strict=True):
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])
    with pytest.raises(zoo.ZooError, match="random-access source"):
        pipeline.train_batches(iter(records), 8, 0)


def test_batch_size_must_split_over_shards():
    with pytest.raises(zoo.ZooError, match="batch_size=6"):
        pipeline.train_batches(column(10), 6, 0, 0, 4)


def test_xor_data_matches_the_tutorial_recipe():
    splits = get_data("xor").splits({})
    assert splits.train["inputs"].shape == (2500, 2) and splits.eval["inputs"].shape == (500, 2)
    corners = np.round(splits.train["inputs"]).astype(int)
    np.testing.assert_array_equal(splits.train["label"], corners[:, 0] ^ corners[:, 1])
    noise = splits.train["inputs"] - corners
    assert 0.09 < noise.std() < 0.11
    again = get_data("xor").splits({})
    np.testing.assert_array_equal(again.eval["inputs"], splits.eval["inputs"])

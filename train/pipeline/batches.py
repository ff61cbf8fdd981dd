"""Generic Grain pipelines: columns of arrays or random-access sources in, fixed-shape batches out.

Each Grain record is a whole batch. A per-example Grain chain (shuffle -> batch) costs about
1.7 ms per batch here, ten times a small model's step; gathering a batch with one numpy
fancy-index from a per-epoch permutation costs about 10 us, and the pipeline stays a Grain
dataset whose iterator state checkpoints and restores exactly. A random-access source (a user's
Grain `MapDataset`, say) is batched the same way, its records gathered and stacked per batch,
and so is an `ExampleSource`, which makes each example itself (decodes a file, augments it).

With `workers` > 0 the training batches are made in that many Grain worker processes
(`zoo.engine.pipeline.workers`), each making whole batches (batch b in worker b mod N), handed to the
loop through shared memory. The iterator's state is then still the index of the next batch,
the same form as without workers, so a checkpoint resumes with any number of workers, and the
batches do not depend on it.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np
from zoo.engine.errors import ZooError
from zoo.engine.registry import Batch, Splits

if TYPE_CHECKING:  # Grain (and Orbax, which it imports) only once batches are made
    import grain

MASK = "mask"
"""Eval batches carry this column: 1.0 for a real example, 0.0 for padding."""

_ENDLESS = 2**62

RandomAccess = Sequence[Mapping[str, np.ndarray]]
"""Anything with `__len__` and `__getitem__(index) -> {column: array}`, e.g. a `MapDataset`."""


class ExampleSource(abc.ABC):
    """A split whose examples are made one at a time: decoded from files or records and, for
    training, augmented. Every random draw of an example depends on (seed, example, epoch)
    alone, so reruns, resumes and any number of processes or workers see the same examples."""

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def examples(self, rows: np.ndarray, epochs: np.ndarray | None, seed: int) -> Batch:
        """The examples `rows` as one batch of columns: augmented as drawn in `epochs` (one per
        row) for training, or as evaluated (`epochs` None)."""


class _Columns:
    """In-memory columns: a batch is one numpy fancy-index per column."""

    def __init__(self, arrays: Mapping[str, np.ndarray], what: str):
        self._arrays = {name: np.asarray(value) for name, value in arrays.items()}
        lengths = {name: len(value) for name, value in self._arrays.items()}
        if not lengths or len(set(lengths.values())) != 1 or 0 in lengths.values():
            raise ZooError(f"The {what} split needs columns of one non-zero length, got {lengths}.")
        self._n = next(iter(lengths.values()))

    def __len__(self) -> int:
        return self._n

    def take(self, rows: np.ndarray, epochs: np.ndarray | None = None, seed: int = 0) -> Batch:
        return {name: value[rows] for name, value in self._arrays.items()}


class _Records:
    """A source of records made one at a time: an `ExampleSource`, whose batch is its examples,
    made (and augmented) by the source; or a random-access source (a Grain `MapDataset`, or
    anything with `__len__` and a `__getitem__` that returns a dict of arrays), whose batch is
    its records, stacked."""

    def __init__(self, source: ExampleSource | RandomAccess, what: str):
        if len(source) == 0:
            raise ZooError(f"The {what} split is empty.")
        self._source = source

    def __len__(self) -> int:
        return len(self._source)

    def take(self, rows: np.ndarray, epochs: np.ndarray | None = None, seed: int = 0) -> Batch:
        if isinstance(self._source, ExampleSource):
            return self._source.examples(rows, epochs, seed)
        records = [self._source[int(row)] for row in rows]
        return {name: np.stack([np.asarray(r[name]) for r in records]) for name in records[0]}


class WithColumns(ExampleSource):
    """A split with per-example columns joined to it: row r of each of `columns` belongs to
    example r (values computed from the split itself before training, say)."""

    def __init__(self, data: Mapping[str, np.ndarray] | RandomAccess, columns: Batch, what: str):
        self._table = _table(data, what)
        self._columns = {name: np.asarray(value) for name, value in columns.items()}
        wrong = {n: len(c) for n, c in self._columns.items() if len(c) != len(self._table)}
        if wrong:
            raise ZooError(f"The {what} split has {len(self._table)} examples; columns {wrong}.")

    def __len__(self) -> int:
        return len(self._table)

    def examples(self, rows: np.ndarray, epochs: np.ndarray | None, seed: int) -> Batch:
        joined = {name: value[rows] for name, value in self._columns.items()}
        return {**self._table.take(rows, epochs, seed), **joined}


def _table(data: Mapping[str, np.ndarray] | RandomAccess, what: str) -> _Columns | _Records:
    if isinstance(data, ExampleSource):
        return _Records(data, what)
    if isinstance(data, Mapping):
        return _Columns(data, what)
    if hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        return _Records(data, what)
    raise ZooError(
        f"The {what} split must be a dict of arrays or a random-access source (a Grain "
        f"MapDataset, or any object with __len__ and __getitem__), got {type(data).__name__}."
    )


def training_rows(data: Mapping[str, np.ndarray] | RandomAccess) -> int:
    """The rows one epoch of the training split `data` visits (a packed row counts once)."""
    return len(_table(data, "train"))


class _TrainBatch:
    """Batch b of an endless stream that visits every example once per epoch, in a fresh order
    each epoch. Batches run across epoch boundaries, so no example is ever dropped and every
    batch has the same shape."""

    def __init__(self, data, batch_size: int, seed: int, shard_index: int, shard_count: int):
        self._table = _table(data, "train")
        self._n = len(self._table)
        self._global_batch = batch_size
        self._local_batch = batch_size // shard_count
        self._offset = shard_index * self._local_batch
        self._seed = seed
        self._cached_epoch, self._cached_perm = -1, np.empty(0, np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._cached_epoch:
            rng = np.random.default_rng([self._seed, epoch])
            self._cached_epoch, self._cached_perm = epoch, rng.permutation(self._n)
        return self._cached_perm

    def __call__(self, index: int) -> dict[str, np.ndarray]:
        start = index * self._global_batch + self._offset
        rows = np.empty(self._local_batch, np.int64)
        epochs = np.empty(self._local_batch, np.int64)
        filled = 0
        while filled < self._local_batch:
            epoch, position = divmod(start + filled, self._n)
            take = min(self._local_batch - filled, self._n - position)
            rows[filled : filled + take] = self._permutation(epoch)[position : position + take]
            epochs[filled : filled + take] = epoch
            filled += take
        return self._table.take(rows, epochs, self._seed)


class _EvalBatch:
    """Batch b of one ordered pass; the last batch is padded to full size and masked."""

    def __init__(self, data, batch_size: int, shard_index: int, shard_count: int):
        self._table = _table(data, "eval")
        self._n = len(self._table)
        self._global_batch = batch_size
        self._local_batch = batch_size // shard_count
        self._offset = shard_index * self._local_batch

    def __call__(self, index: int) -> dict[str, np.ndarray]:
        positions = index * self._global_batch + self._offset + np.arange(self._local_batch)
        real = positions < self._n
        rows = np.where(real, positions, 0)
        batch = self._table.take(rows)
        batch[MASK] = real.astype(np.float32)
        return batch


def _check_batch(batch_size: int, shard_count: int) -> None:
    if batch_size < 1 or batch_size % shard_count:
        raise ZooError(
            f"trainer.batch_size={batch_size} must be a positive multiple of the "
            f"{shard_count} data shards it is split into."
        )


def train_batches(
    data: Mapping[str, np.ndarray] | RandomAccess,
    batch_size: int,
    seed: int,
    shard_index: int = 0,
    shard_count: int = 1,
    transform: Callable[[Batch], Batch] | None = None,
    augment: Callable[[Batch, np.random.Generator], Batch] | None = None,
    workers: int = 0,
) -> grain.IterDataset:
    """Endless shuffled training batches; this process's share of each global batch, made in
    `workers` processes (0: in this one).

    `augment(batch, rng)` gets a generator that Grain derives from (seed, shard, batch index):
    the same augmentations on every rerun and after a resume, and different ones per process."""
    import grain

    _check_batch(batch_size, shard_count)
    gather = _TrainBatch(data, batch_size, seed, shard_index, shard_count)
    dataset = grain.MapDataset.range(_ENDLESS).map(gather)
    if augment is not None:
        augment_seed = int(np.random.SeedSequence([seed, shard_index]).generate_state(1)[0])
        dataset = dataset.random_map(lambda b, rng: {**b, **augment(b, rng)}, seed=augment_seed)
    if transform is not None:
        dataset = dataset.map(_updating(transform))
    if workers < 0:
        raise ZooError(f"data.workers={workers} must be 0 (no worker processes) or more.")
    if workers:
        from zoo.engine.pipeline.workers import InWorkers

        return InWorkers(dataset, workers, _inline_reads())
    return dataset.to_iter_dataset(_inline_reads())


def _inline_reads() -> grain.ReadOptions:
    """Grain's options for reading batches in this process (in it or in a worker): no
    threads, no prefetch."""
    import grain

    return grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def peek(train: grain.IterDataset) -> Batch:
    """The first training batch, made in this process (no worker is started for it)."""
    from zoo.engine.pipeline.workers import InWorkers

    if isinstance(train, InWorkers):
        return train.batches[0]
    iterator = iter(train)
    try:
        return next(iterator)
    finally:
        iterator.close()


def eval_batches(
    data: Mapping[str, np.ndarray] | RandomAccess,
    batch_size: int,
    shard_index: int = 0,
    shard_count: int = 1,
    transform: Callable[[Batch], Batch] | None = None,
) -> grain.MapDataset:
    """One ordered pass over every example exactly once, in fixed-shape batches with a `mask`."""
    import grain

    _check_batch(batch_size, shard_count)
    gather = _EvalBatch(data, batch_size, shard_index, shard_count)
    dataset = grain.MapDataset.range(math.ceil(len(gather._table) / batch_size)).map(gather)
    return dataset if transform is None else dataset.map(_updating(transform))


def _updating(transform: Callable[[Batch], Batch]) -> Callable[[Batch], Batch]:
    """A transform returns the columns it changes; the others (the eval `mask`) pass through."""
    return lambda batch: {**batch, **transform(batch)}


def process_pipelines(
    splits: Splits, batch_size: int, seed: int
) -> tuple[grain.IterDataset, grain.MapDataset]:
    """This process's training and eval batches of `splits` (all of them with one process)."""
    shard = {"shard_index": jax.process_index(), "shard_count": jax.process_count()}
    train = train_batches(
        splits.train,
        batch_size,
        seed,
        transform=splits.transform,
        augment=splits.augment,
        workers=splits.workers,
        **shard,
    )
    return train, eval_batches(splits.eval, batch_size, transform=splits.transform, **shard)


def example_bytes(splits: Splits) -> tuple[int, int]:
    """(bytes, bytes once transformed) of one training example, measured on the first one."""
    table = _table(splits.train, "train")
    first = table.take(np.zeros(1, np.int64))
    shown = {**first, **(splits.transform(first) if splits.transform is not None else {})}
    return _nbytes(first), _nbytes(shown)


def _nbytes(batch: Batch) -> int:
    return sum(np.asarray(column).nbytes for column in batch.values())


HOST_MEMORY_SHARE = 0.8


def check_host_memory(splits: Splits, batch_size: int, steps_per_dispatch: int) -> None:
    """Refuse a batch that cannot fit in this machine's memory, before any is gathered.

    One dispatch's batches are held about four times over at their peak: gathered, transformed,
    stacked (K > 1) and placed on the devices (CPU devices share the host's memory). They may
    take at most `HOST_MEMORY_SHARE` of the memory available: the data set, the model and the
    libraries need the rest."""
    available = available_memory()
    if available is None:
        return
    raw, shown = example_bytes(splits)
    examples = batch_size * steps_per_dispatch
    needed = examples * (raw + 3 * shown)
    if needed > HOST_MEMORY_SHARE * available:
        raise ZooError(
            f"trainer.batch_size={batch_size} with trainer.steps_per_dispatch="
            f"{steps_per_dispatch} needs about {needed / 2**30:,.1f} GiB of host memory for one "
            f"dispatch's batches ({examples:,} examples of {raw:,} B, {shown:,} B once "
            f"transformed, held about four times over), more than {HOST_MEMORY_SHARE:.0%} of the "
            f"{available / 2**30:,.1f} GiB this machine has available. Use a smaller "
            "trainer.batch_size or trainer.steps_per_dispatch."
        )


def available_memory() -> int | None:
    """Bytes of memory the kernel says are available (Linux's MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None

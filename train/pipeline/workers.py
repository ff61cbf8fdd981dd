"""Training batches made in Grain worker processes (`data.workers` > 0): `InWorkers`, the
`zoo.engine.pipeline.batches` dataset that starts them, and what each worker runs first."""

from __future__ import annotations

import ctypes
import os
import signal
from typing import Any

import grain
import numpy as np
from zoo.engine.registry import Batch


class InWorkers(grain.IterDataset):
    """The batches of an endless `MapDataset`, made in `workers` Grain processes (each reading
    them with `reads`). Its iterator's state is `{"next_index": b}`, as the inline pipeline's
    is: restoring a state restarts the workers at batch b, whatever their number was when it
    was saved."""

    def __init__(self, batches: grain.MapDataset, workers: int, reads: grain.ReadOptions):
        super().__init__()
        self.batches, self.workers, self.reads = batches, workers, reads

    def __iter__(self) -> grain.DatasetIterator:
        return _InWorkersIterator(self.batches, self.workers, self.reads)


class _InWorkersIterator(grain.DatasetIterator):
    def __init__(self, batches: grain.MapDataset, workers: int, reads: grain.ReadOptions):
        super().__init__()
        self._batches, self._workers, self._reads = batches, workers, reads
        self._next = 0
        self._inner: grain.DatasetIterator | None = None  # started on the first batch

    def __next__(self) -> Batch:
        if self._inner is None:
            _flags_parsed()
            options = grain.MultiprocessingOptions(num_workers=self._workers)
            rest = self._batches[self._next :].to_iter_dataset(self._reads)
            init = _WorkerInit(os.getpid())
            self._inner = iter(rest.mp_prefetch(options, worker_init_fn=init))
        batch = next(self._inner)
        self._next += 1
        # Out of the worker's shared memory at once: the block is freed here, not whenever the
        # last view of it (a device buffer on CPU, say) goes.
        return {name: np.array(column) for name, column in batch.items()}

    def get_state(self) -> dict[str, Any]:
        return {"next_index": self._next}

    def set_state(self, state: dict[str, Any]) -> None:
        self.close()
        self._next = int(state["next_index"])

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()
            self._inner = None


def _flags_parsed() -> None:
    """Grain reads absl flags; in a process that never parsed them (any but an absl app) that
    fails, unless they count as parsed."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


class _WorkerInit:
    """Runs first in each worker process: it dies with the training process (killed or not,
    a worker never outlives it), and absl's flags count as parsed (Grain reads them, and a
    process that imported JAX otherwise fails to).

    Linux signals a child when the *thread* that started it ends (`PR_SET_PDEATHSIG`), and
    Grain starts workers from threads of its own that end when the pipeline is closed; a
    worker killed then would leave its last batches' shared memory behind. So the signal only
    makes the worker look: it exits when its parent process is gone, and otherwise carries on
    and stops as Grain asks it to, freeing what it holds."""

    def __init__(self, parent: int):
        self.parent = parent

    def __call__(self, index: int, count: int) -> None:
        _flags_parsed()
        if hasattr(signal, "SIGUSR1") and os.path.exists("/proc/self"):  # Linux
            signal.signal(signal.SIGUSR1, self._on_parent_change)
            pr_set_pdeathsig = 1
            ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGUSR1)
        self._on_parent_change()  # the parent may have died before the lines above

    def _on_parent_change(self, *signal_args: Any) -> None:
        if os.getppid() != self.parent:
            os._exit(1)

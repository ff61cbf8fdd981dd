"""What the training loop reports besides its metrics: speed, time waiting for data,
compilations, update norms, histograms and profiler traces.

All of it is host-side bookkeeping around the loop (clock reads, JAX's compile events) or work
dispatched to the device and fetched a log window later, so none of it makes the host wait on a
training step, and none of it touches the train state: a run's bits do not depend on it.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
from jax import monitoring
from zoo.engine.report.memory import device_memory
from zoo.engine.report.reporter import Reporter
from zoo.engine.steps.functions import COUNT

log = logging.getLogger("zoo")
_timing_log = logging.getLogger("train.timing")  # train.log only, not the console

MAX_IN_FLIGHT = 8
"""How many dispatches the host may run ahead of the devices. A few keep every device busy;
more buy nothing but memory, and with 8 simulated CPU devices deep queues (hundreds of tiny
steps) occasionally deadlocked XLA:CPU's all-reduce rendezvous (about 1 run in 3 of 1,954 XOR
steps)."""

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
"""JAX's event for one XLA compilation; tracing and lowering come before it."""
_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    BACKEND_COMPILE,
)


class WindowClock:
    """Wall time of each log window, and how much of it the host spent getting batches
    (`next(iterator)` and sharding): a share near 1 means the devices wait for data."""

    def __init__(self, step: int, batch_size: int):
        self._batch_size = batch_size
        self._step, self._time, self._waiting = step, time.perf_counter(), 0.0

    @contextlib.contextmanager
    def waiting_for_data(self) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self._waiting += time.perf_counter() - started

    def lap(self, step: int) -> dict[str, float]:
        """`steps_per_sec`, `examples_per_sec` and `data_wait_share` since the last lap."""
        now = time.perf_counter()
        seconds = now - self._time
        steps_per_sec = (step - self._step) / seconds
        speed = {
            "steps_per_sec": steps_per_sec,
            "examples_per_sec": steps_per_sec * self._batch_size,
            "data_wait_share": self._waiting / seconds,
        }
        self._step, self._time, self._waiting = step, now, 0.0
        return speed


class CompileWatch:
    """Counts the XLA compilations of this process while installed, and the seconds spent
    tracing, lowering and compiling: a count that keeps growing means a step recompiles."""

    def __init__(self, before: Mapping[str, float] | None = None) -> None:
        """`before`: the totals of the processes a resumed run ran in before this one."""
        self.count = int((before or {}).get("count", 0))
        self.seconds = float((before or {}).get("seconds", 0.0))

    def _record(self, event: str, duration: float, **_: Any) -> None:
        if event in _COMPILE_EVENTS:
            self.seconds += duration
            self.count += event == BACKEND_COMPILE

    @contextlib.contextmanager
    def installed(self) -> Iterator[CompileWatch]:
        monitoring.register_event_duration_secs_listener(self._record)
        try:
            yield self
        finally:
            monitoring.unregister_event_duration_listener(self._record)

    def totals(self) -> dict[str, float]:
        return {"count": float(self.count), "seconds": self.seconds}


class Deferred:
    """Work dispatched to the device before the train step of the steps where `due(step)`,
    on the state, batch and key that step gets, and handed to `write(step, result)` once a log
    window ending at or after that step is reported: by then the device has long finished it,
    so fetching it never makes the host wait."""

    def __init__(
        self,
        step_fn: Callable,
        due: Callable[[int], bool],
        write: Callable[[int, Mapping[str, Any]], None],
    ):
        self._step_fn, self._due, self._write = step_fn, due, write
        self._pending: list[tuple[int, Mapping[str, Any]]] = []

    def before_step(self, step: int, state: Any, batch: Mapping[str, jax.Array], key) -> None:
        if self._due(step):
            self._pending.append((step, self._step_fn(state, batch, key)))

    def write(self, up_to: int) -> None:
        """Write the results of steps <= `up_to`."""
        due = [(step, result) for step, result in self._pending if step <= up_to]
        self._pending = [(step, result) for step, result in self._pending if step > up_to]
        for step, result in due:
            self._write(step, jax.device_get(result))


class ProfileWindow:
    """A JAX profiler trace of steps `first..last` (`trainer.profile_steps`), written under
    `<workdir>/plugins/profile/`, where TensorBoard's profile plugin finds it."""

    def __init__(self, workdir: str, steps: Sequence[int]):
        self._workdir = workdir
        self._first, self._last = (steps[0], steps[1]) if steps else (None, None)
        self._active = False

    def before_step(self, step: int) -> None:
        if step == self._first:
            jax.profiler.start_trace(self._workdir)
            self._active = True

    def marker(self, step: int) -> contextlib.AbstractContextManager:
        """Marks a dispatch as step `step` in the trace, so the Profile tab's overview finds
        the steps (only while tracing)."""
        if not self._active:
            return contextlib.nullcontext()
        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def after_step(self, step: int, outputs: Any) -> None:
        if self._active and step == self._last:
            jax.block_until_ready(outputs)  # the trace ends when the last step has run
            self.close()
            log.info("Profiler trace of steps %d-%d in %s", self._first, step, self._workdir)

    def close(self) -> None:
        if self._active:
            jax.profiler.stop_trace()
            self._active = False


class InFlight:
    """Keeps the host at most `limit` dispatches ahead of the devices: before the next one, it
    waits for the one `limit` back."""

    def __init__(self, limit: int = MAX_IN_FLIGHT):
        self._limit = limit
        self._queue: collections.deque[jax.Array] = collections.deque()

    def add(self, marker: jax.Array) -> None:
        self._queue.append(marker)
        if len(self._queue) > self._limit:
            self._queue.popleft().block_until_ready()


class Instruments:
    """What the loop measures around each dispatch of K steps: the profiler trace, the
    update-norm and histogram probes (K=1 only: they need the state before each step, which a
    scan hides), compilations, and how far the host runs ahead."""

    def __init__(
        self,
        *,
        profile: ProfileWindow,
        probes: Sequence[Deferred],
        steps_per_dispatch: int,
        first_step: int,
        compiled_before: Mapping[str, float] | None = None,
        devices: Sequence[Any] = (),
    ):
        self.profile, self.probes = profile, probes
        self._devices = devices  # this process's devices of the mesh, for their memory
        self.compiles = CompileWatch(compiled_before)
        self._k, self._first = steps_per_dispatch, first_step
        self._in_flight = InFlight()
        self._compiled_at: dict[int, dict[str, float]] = {}  # totals as each step was dispatched

    @contextlib.contextmanager
    def installed(self) -> Iterator[Instruments]:
        with self.compiles.installed(), contextlib.closing(self.profile):
            yield self

    def before(self, step: int, state: Any, batches: Mapping[str, jax.Array], key) -> None:
        """Before dispatching steps `step - K + 1 .. step`: start the profiler's trace at its
        first step, and dispatch the probes due at `step` on the state and batch it gets."""
        for s in range(step - self._k + 1, step + 1):
            self.profile.before_step(s)
        if self._k == 1:
            for probe in self.probes:
                probe.before_step(step, state, batches, key)

    def after(self, step: int, sums: Mapping[str, jax.Array]) -> None:
        """After dispatching them (`sums`: the dispatch's outputs): stop the trace at its last
        step, wait for the dispatch `MAX_IN_FLIGHT` back, note the compilations so far."""
        if step == self._first:  # compiled (on a first run) and running
            _timing_log.info("First dispatch of this run: steps %d-%d", step - self._k + 1, step)
        for s in range(step - self._k + 1, step + 1):
            self.profile.after_step(s, sums)
        self._in_flight.add(sums[COUNT])
        self._compiled_at[step] = self.compiles.totals()

    def report(self, step: int, reporter: Reporter) -> None:
        """With the log window that ends at `step` (reported a window later): compilations up
        to `step`'s dispatch, the probes' results up to `step` (finished on the device long
        ago), and the device memory as the report is written (GPUs, TPUs)."""
        totals = self._compiled_at.get(step, self.compiles.totals())
        self._compiled_at = {s: t for s, t in self._compiled_at.items() if s > step}
        compiles = {f"compile_{name}": value for name, value in totals.items()}
        reporter.scalars("xla", step, {**compiles, **device_memory(self._devices)})
        for probe in self.probes:
            probe.write(up_to=step)

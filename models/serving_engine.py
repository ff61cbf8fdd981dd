"""Continuous batching: many clients' prompts decoded together by one language model, each row
of the batch a slot that a request holds from its prefill to its last token.

The `Engine` allocates, once, a key/value cache of `rows` x `max_length` slots (the memory of
the batch is that product, whatever the traffic) and compiles, at warm-up, one prefill per prompt
bucket (`zoo.models.sampling_loop.prompt_bucket`, up to `max_length`) and one decode step of all
rows. A request waits in a bounded queue (`QueueFull` beyond it) until a row is free; between two
decode steps it is prefilled alone, left-padded to its bucket, and its cache row, moved left by
the padding so that the prompt holds its first slots, is written into the free row
(`zoo.models.kv_cache.write_row`), so it joins the running batch at the next step: the reply
has every slot after the prompt's, whatever its bucket's padding.
Each row has its own slot index (`Slots.index` one per row), positions and sampling controls
(temperature 0 is greedy, row by row), and draws its token number `t` from `fold_in(key, t)`,
`key` the request's own (`fold_in(key(seed), choice)`): what a request writes does not depend on
which others share the batch, and equals what `zoo.generate` writes for it with that seed. A row
frees at its end-of-sequence id, its stop, its `max_new_tokens`, or when its client goes away
(`Ticket.cancel`), and the next request in the queue takes it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
from zoo.models.kv_cache import write_row
from zoo.models.sampling_loop import (
    SMALLEST_BUCKET,
    Sampling,
    Structure,
    choose,
    decoded,
    prefilled,
    prompt_bucket,
    require_language_model,
    step_keys,
)

from zoo.plugin import ZooError, unsplit_batch, widened_copies

log = logging.getLogger("zoo.generation")

COMPILATIONS: collections.Counter = collections.Counter()
"""How many times the engine's functions were compiled: ("admit", bucket) and ("step", rows)."""

TOP_LOGPROBS = 20
"""The most alternatives a token's log-probabilities list (OpenAI's own limit)."""

FILTERS = ("top_k", "top_p", "min_p")
"""Every row's sampler applies all filters, each at its row's value (no limit: a pass-through)."""


class QueueFull(ZooError):
    """The queue of waiting requests holds as many as it may: try again later."""


class EngineStopped(ZooError):
    """The engine's thread ended on an error: no request can run until the server restarts."""


@dataclasses.dataclass(frozen=True)
class Ask:
    """One row's request: the prompt's ids, at most `max_new_tokens` new ones chosen as
    `sampling` says (temperature 0: greedy) with the key `fold_in(key(seed), choice)`, ending at
    an id of `eos` or once `stop(its tokens)` is true."""

    prompt: np.ndarray
    max_new_tokens: int
    sampling: Sampling = dataclasses.field(default_factory=Sampling)
    seed: int = 0
    choice: int = 0
    eos: frozenset[int] = frozenset()
    stop: Callable[[list[int]], bool] | None = None


@dataclasses.dataclass(frozen=True)
class Token:
    """A new token of a row, its log-probability, and the likeliest tokens with theirs."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclasses.dataclass(frozen=True)
class Finished:
    """The end of a row: `eos`, `stop`, `length`, `cancelled`, or `error` (the engine
    stopped: `Engine.failure`)."""

    reason: str


class Ticket:
    """A request's place in the engine: its events (each `Token`, then one `Finished`) go to
    `deliver`, called from the engine's thread; `cancel` frees its row at the next step."""

    def __init__(self, ask: Ask, deliver: Callable[[Token | Finished], None]):
        self.ask, self.deliver, self.cancelled = ask, deliver, False
        self.tokens: list[int] = []

    def cancel(self) -> None:
        self.cancelled = True


class Engine:
    """The scheduler and its slot-pooled cache (see the module). Call `start` once (it warms
    up, then decodes in a thread of its own), `submit` from any thread, `stop` at the end.
    `context`: what each compiled call runs in (the model's mesh)."""

    def __init__(
        self,
        model: Any,
        rows: int,
        max_length: int,
        queue_size: int,
        context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ):
        require_language_model(model)
        if not (rows >= 1 and queue_size >= 0 and SMALLEST_BUCKET < max_length):
            raise ZooError(
                f"rows={rows}, queue_size={queue_size}, max_length={max_length}: give at least "
                f"1 row, a queue of 0 or more, and a max_length above {SMALLEST_BUCKET}."
            )
        self.model, self.rows, self.queue_size, self._context = model, rows, queue_size, context
        self.max_length = min(max_length, model.context_length)
        graphdef, state = nnx.split(model)
        leaves, treedef = jax.tree.flatten(state)
        self._structure = Structure((graphdef, treedef))
        self._weights = (leaves, widened_copies(leaves))
        self.top = min(TOP_LOGPROBS, model.vocab_size)
        self.buckets = sorted(
            {prompt_bucket(n, self.max_length) for n in _lengths(self.max_length)}
        )
        with self._calls():
            self._pool = model.empty_cache(rows, self.max_length)
            self._blank = model.empty_cache(1, self.max_length)
        self._state = _Rows(rows)
        self._held: list[Ticket | None] = [None] * rows
        self._queue: collections.deque[Ticket] = collections.deque()
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running = False
        self.cancelled = 0
        self.failure: str | None = None

    def check(self, ask: Ask) -> None:
        """Refuse, by name, a request the engine cannot run."""
        if len(ask.prompt) < 1:
            raise ZooError("An empty prompt: give at least one token.")
        if len(ask.prompt) >= self.max_length:
            raise ZooError(
                f"The prompt has {len(ask.prompt)} tokens; this server holds {self.max_length} "
                f"per request (prompt and reply together): give a prompt of at most "
                f"{self.max_length - 1} tokens."
            )
        room = self.room(len(ask.prompt))
        if not 1 <= ask.max_new_tokens <= room:
            raise ZooError(
                f"max_tokens={ask.max_new_tokens} must lie between 1 and {room} for a prompt of "
                f"{len(ask.prompt)} tokens: prompt and reply share the {self.max_length} slots "
                f"a request holds, and the model's context of {self.model.context_length}."
            )
        ask.sampling.check(self.model.vocab_size)
        if not 0 <= ask.seed < 2**31:
            raise ZooError(f"seed={ask.seed} must lie between 0 and {2**31 - 1}.")

    def bucket(self, length: int) -> int:
        return prompt_bucket(length, self.max_length)

    def room(self, length: int) -> int:
        """The most new tokens after a prompt of `length` tokens: the reply's tokens but the
        last take the row's slots after the prompt's, and prompt and reply share the model's
        context."""
        return min(self.max_length - length + 1, self.model.context_length - length)

    def submit(self, asks: list[Ask], deliver: Callable[[int, Token | Finished], None]):
        """Queue `asks` (the choices of one request, all or none): their `Ticket`s, whose events
        go to `deliver(index in asks, event)`. `QueueFull` where they do not fit."""
        for ask in asks:
            self.check(ask)
        with self._lock:
            if self.failure is not None:
                raise EngineStopped(
                    f"The serving engine stopped after an error ({self.failure}): restart the "
                    "server."
                )
            if len(self._queue) + len(asks) > self.queue_size + self._free_rows():
                raise QueueFull(
                    f"The server is busy: {len(self._queue)} requests wait for its {self.rows} "
                    f"rows, and its queue holds {self.queue_size}. Try again shortly."
                )
            tickets = [Ticket(a, functools.partial(deliver, i)) for i, a in enumerate(asks)]
            self._queue.extend(tickets)
            self._lock.notify()
        return tickets

    def stats(self) -> dict[str, int]:
        """Rows busy, requests waiting, and rows freed by clients that went away."""
        with self._lock:
            busy = sum(t is not None for t in self._held)
            return {"rows": self.rows, "busy": busy, "queued": len(self._queue),
                    "cancelled": self.cancelled}  # fmt: skip

    def start(self) -> None:
        """Compile every function (each bucket's prefill, the decode step), then decode in a
        thread of the engine's own."""
        for bucket in self.buckets:
            self._admit(Ticket(Ask(np.zeros(bucket, np.int32), 1), lambda event: None), 0)
        self._step()
        self._state.clear(0)
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="zoo-serving", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._running = False
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()

    def _free_rows(self) -> int:
        return sum(t is None for t in self._held)

    def _loop(self) -> None:
        try:
            self._decode()
        except Exception as e:  # every client waiting is told; none is left hanging
            log.exception("The serving engine stopped")
            self._failed(e)

    def _failed(self, e: Exception) -> None:
        with self._lock:
            self.failure = f"{type(e).__name__}: {e}"
            tickets = [t for t in self._held if t is not None] + list(self._queue)
            self._held, self._running = [None] * self.rows, False
            self._queue.clear()
        for ticket in tickets:
            ticket.deliver(Finished("error"))

    def _decode(self) -> None:
        while True:
            with self._lock:
                while self._running and not self._queue and self._free_rows() == self.rows:
                    self._lock.wait()
                if not self._running:
                    return
                admitted = self._take()
            for row, ticket in admitted:
                self._after(row, *self._admit(ticket, row))
            if self._free_rows() < self.rows:
                for row, event in self._step():
                    self._after(row, *event)

    def _take(self) -> list[tuple[int, Ticket]]:
        """The waiting tickets that free rows take now (cancelled ones dropped)."""
        taken = []
        for row in range(self.rows):
            while self._held[row] is None and self._queue:
                ticket = self._queue.popleft()
                if ticket.cancelled:
                    self.cancelled += 1
                    continue
                self._held[row] = ticket
                taken.append((row, ticket))
        return taken

    def _calls(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(self._context())
        stack.enter_context(unsplit_batch())
        return stack

    def _admit(self, ticket: Ticket, row: int) -> tuple[int, float, tuple]:
        """Prefill `ticket`'s prompt alone into `row`; its first token's event."""
        ask = ticket.ask
        bucket = self.bucket(len(ask.prompt))
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, bucket - len(ask.prompt) :] = ask.prompt
        first = np.asarray([bucket - len(ask.prompt)], np.int32)
        controls, greedy = _controls([ask.sampling], self.model.vocab_size)
        with self._calls():
            token, logprob, top, key, self._pool = _admit(
                self._structure, self._weights, self._pool, self._blank, tokens, first,
                np.int32(row), np.uint32(ask.seed), np.uint32(ask.choice), controls, greedy,
                self.top,
            )  # fmt: skip
        self._state.fill(row, len(ask.prompt), np.asarray(key), ask.sampling)
        return _events(token, logprob, top)[0]

    def _step(self) -> list[tuple[int, tuple]]:
        """One decode step of every row; the events of the rows that are held."""
        s = self._state
        controls, greedy = _controls(s.sampling, self.model.vocab_size)
        # Copies: a CPU call may read a NumPy array in place while it runs, after the host has
        # moved on to change it.
        rows = (a.copy() for a in (s.token, s.index, s.keys, s.steps))
        with self._calls():
            token, logprob, top, self._pool = _step(
                self._structure, self._weights, self._pool, *rows, controls, greedy, self.top
            )
        s.index += 1
        s.steps += 1
        events = _events(token, logprob, top)
        return [(row, events[row]) for row in range(self.rows) if self._held[row] is not None]

    def _after(self, row: int, token: int, logprob: float, top) -> None:
        """Deliver a row's new token; free the row where it ended."""
        ticket = self._held[row]
        ask = ticket.ask
        self._state.token[row] = token
        reason = None
        if ticket.cancelled:
            reason = "cancelled"
        elif token in ask.eos:
            reason = "eos"
        else:
            ticket.tokens.append(token)
            ticket.deliver(Token(token, logprob, top))
            if ask.stop is not None and ask.stop(ticket.tokens):
                reason = "stop"
            elif len(ticket.tokens) >= ask.max_new_tokens:
                reason = "length"
        if reason is not None:
            with self._lock:
                self._held[row] = None
                self.cancelled += reason == "cancelled"
            self._state.clear(row)
            ticket.deliver(Finished(reason))


def _lengths(max_length: int) -> list[int]:
    """A prompt length in each bucket up to `max_length`."""
    lengths, n = [1], SMALLEST_BUCKET
    while n < max_length:
        lengths.append(n + 1)
        n *= 2
    return [n for n in lengths if n < max_length]


class _Rows:
    """The host's record of every row: its last token, next slot, key, token count and
    sampling controls (an idle row decodes at slot 0, which nobody reads). Every row's prompt
    starts at slot 0 (`_admit` moves it there)."""

    def __init__(self, rows: int):
        self.token = np.zeros(rows, np.int32)
        self.index = np.zeros(rows, np.int32)
        self.steps = np.zeros(rows, np.int32)
        self.keys = np.zeros((rows, *jax.random.key_data(jax.random.key(0)).shape), np.uint32)
        self.sampling = [Sampling(temperature=0.0)] * rows

    def fill(self, row: int, index: int, key: np.ndarray, sampling: Sampling):
        self.index[row], self.steps[row] = index, 1
        self.keys[row], self.sampling[row] = key, sampling

    def clear(self, row: int) -> None:
        self.fill(row, 0, self.keys[row], Sampling(temperature=0.0))


def _controls(samplings: list[Sampling], vocab: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The rows' sampling controls as arrays (one value per row; top_k 0, no limit, as the
    whole vocabulary), and which rows are greedy."""
    values = [dataclasses.replace(s, top_k=s.top_k or vocab).values() for s in samplings]
    controls = {name: np.stack([v[name] for v in values]) for name in values[0]}
    return controls, np.asarray([s.temperature == 0 for s in samplings])


def _events(token, logprob, top) -> list[tuple[int, float, tuple]]:
    token, logprob, top_ids, top_logprobs = (np.asarray(a) for a in (token, logprob, *top))
    return [
        (int(t), float(lp), tuple(zip(map(int, ids), map(float, lps), strict=True)))
        for t, lp, ids, lps in zip(token, logprob, top_ids, top_logprobs, strict=True)
    ]


def _chosen(logits, keys, steps, controls, greedy, top: int):
    """Each row's token as its own controls say (greedy where `greedy`), its log-probability,
    and the `top` likeliest tokens with theirs."""
    keys = step_keys(keys, steps)
    token, logprob = choose(logits, keys, controls, FILTERS)
    best, best_logprob = choose(logits, keys, controls, ("greedy",))
    token, logprob = jnp.where(greedy, best, token), jnp.where(greedy, best_logprob, logprob)
    whole = jax.sharding.reshard(logits.astype(jnp.float32), P())  # the vocabulary whole
    logprobs = jax.nn.log_softmax(whole, axis=-1)
    top_logprobs, top_ids = jax.lax.top_k(logprobs, top)
    return token, logprob, (top_ids, top_logprobs)


@functools.partial(jax.jit, static_argnames=("structure", "top"), donate_argnames=("pool",))
def _admit(structure, weights, pool, blank, tokens, first, row, seed, choice, controls, greedy,
           top):  # fmt: skip
    COMPILATIONS["admit", tokens.shape[1]] += 1
    log.debug("compiling the serving prefill of %d tokens", tokens.shape[1])
    logits, one = prefilled(structure, weights, blank, tokens, first)
    # The padding's slots moved to the row's end (a ring's too: each slot moves by the padding,
    # modulo the ring's length), where decoding overwrites them before any token sees them.
    one = jax.tree.map(lambda c: jnp.roll(c, -first[0], axis=c.ndim - 3), one)
    key = jax.random.fold_in(jax.random.key(seed), choice)
    token, logprob, top_ = _chosen(logits, key[None], jnp.int32(0), controls, greedy, top)
    return token, logprob, top_, jax.random.key_data(key), write_row(pool, one, row)


@functools.partial(jax.jit, static_argnames=("structure", "top"), donate_argnames=("pool",))
def _step(structure, weights, pool, token, index, keys, steps, controls, greedy, top):
    COMPILATIONS["step", token.shape[0]] += 1
    log.debug("compiling the serving decode step of %d rows", token.shape[0])
    logits, pool = decoded(structure, weights, pool, token, index, jnp.zeros_like(index))
    keys = jax.random.wrap_key_data(keys)
    return (*_chosen(logits, keys, steps, controls, greedy, top), pool)

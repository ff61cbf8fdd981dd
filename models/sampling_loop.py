"""The sampling loop of every language model (`gpt`, `decoder`), the engine beneath its text
generation (`zoo.models.text_completion`): batches of prompts of any lengths, a key/value cache
donated and updated in place, sampling controls, stops per row, and a stream of tokens as they
come.

The model is used through what it offers, not its class: `decode(tokens, cache, slots)`,
`empty_cache(batch_size, slots)`, `context_length` and `vocab_size`.

A call runs in two compiled functions: a prefill that runs the left-padded prompts through the
model once, filling the cache and choosing every row's first token, then one decode step per
new token, called from Python: the cache is donated to it, so XLA writes the new keys and values
into the same buffers instead of copying them, and each step is dispatched before the host reads
the previous token, so the device never waits for the stop checks. Prompts are padded to a
power-of-two length (a bucket) and the cache's length is fixed by a `Session`, so a session
compiles one prefill per bucket and one decode step (`COMPILATIONS` counts them; each is logged).

Rows are independent: left padding puts every row's next token in the same cache slot, each row
has its own positions and sees only its own real tokens (`zoo.models.kv_cache`), and each row
samples from its own key (`fold_in(key, row)`, then `fold_in(that, step)`), so a prompt decoded
in a batch writes what it writes alone.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
from zoo.models.kv_cache import Slots

from zoo.plugin import ZooError, logical_spec, reading_widened, unsplit_batch, widened_copies

log = logging.getLogger("zoo.generation")
"""Where each compilation is said (DEBUG: a run's console shows INFO)."""

COMPILATIONS: collections.Counter = collections.Counter()
"""How many times each function was compiled: ("prefill", batch, bucket, slots) and
("decode", batch, slots) (and their sampling filters)."""

SMALLEST_BUCKET = 16
"""The shortest length prompts are padded to (then 32, 64, ...)."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How each new token is chosen from the model's next-token logits: greedily (the
    likeliest) at `temperature` 0; else drawn from softmax(logits / temperature) restricted to
    the `top_k` likeliest tokens (0: all), then to the fewest likeliest whose probabilities sum
    to at least `top_p` (1: all), then to those at least `min_p` times as likely as the
    likeliest (0: all), renormalised."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def check(self, vocab_size: int) -> None:
        """Refuse a value outside its range, naming it."""
        problems = []
        if not self.temperature >= 0:
            problems.append(f"temperature={self.temperature} must be >= 0 (0: greedy)")
        if not (isinstance(self.top_k, int) and 0 <= self.top_k <= vocab_size):
            problems.append(f"top_k={self.top_k} must lie between 0 (no limit) and {vocab_size}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p={self.top_p} must lie in (0, 1] (1: no limit)")
        if not 0 <= self.min_p < 1:
            problems.append(f"min_p={self.min_p} must lie in [0, 1) (0: no limit)")
        if problems:
            raise ZooError("; ".join(problems) + ".")

    @property
    def filters(self) -> tuple[str, ...]:
        """What the compiled sampler does (static): `greedy`, or which filters apply."""
        if self.temperature == 0:
            return ("greedy",)
        names = ("top_k", "top_p", "min_p")
        on = (self.top_k > 0, self.top_p < 1, self.min_p > 0)
        return tuple(name for name, used in zip(names, on, strict=True) if used)

    def values(self) -> dict[str, np.ndarray]:
        """The controls as arrays, so that other values reuse the compiled sampler."""
        return {
            "temperature": np.float32(max(self.temperature, 1e-6)),
            "top_k": np.int32(max(self.top_k, 1)),
            "top_p": np.float32(self.top_p),
            "min_p": np.float32(self.min_p),
        }


@dataclasses.dataclass
class Completion:
    """What one prompt's row wrote: its new `tokens` (without the end-of-sequence token that
    ended it), their `logprobs` (log-probabilities under the model's own distribution, before
    temperature and filters; None unless asked), and why it ended (`finish`): `eos`, `stop`
    (a stop string; `text` is cut before it) or `length` (max_new_tokens)."""

    tokens: list[int]
    logprobs: list[float] | None
    finish: str = "length"
    text: str | None = None


@dataclasses.dataclass(frozen=True)
class Token:
    """One new token of one row, as the stream yields it."""

    row: int
    token: int
    logprob: float


class Session:
    """Generation from `model` with a cache of `batch_size` rows and `slots` positions,
    allocated once and reused by every call: at most one prefill compiled per prompt bucket,
    and one decode step. Call it where the model's mesh is active; the batch is not split over
    the mesh (the heads are, on `tensor`)."""

    def __init__(self, model: Any, batch_size: int, slots: int, split: bool = False):
        require_language_model(model)
        self.model, self.batch_size, self.slots = model, batch_size, slots
        self.split = split
        graphdef, state = nnx.split(model)
        leaves, treedef = jax.tree.flatten(state)
        self._structure = Structure((graphdef, treedef))
        # With float32 copies where zoo's bfloat16 CPU kernel does not run (else Nones).
        self._weights = (leaves, widened_copies(leaves))
        with self._rows():
            self._cache = model.empty_cache(batch_size, slots)

    def stream(
        self,
        prompts: Sequence[np.ndarray],
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        seed: int | jax.Array = 0,
        eos: Sequence[int] = (),
        stop: Callable[[int, list[int]], bool] | None = None,
    ) -> Iterator[list[Token]]:
        """The new tokens of the rows still going, one list per step. A row ends at a token
        of `eos` (which is yielded), at `max_new_tokens`, or once `stop(row, its tokens)` is
        true."""
        rows, bucket = self._checked(prompts, max_new_tokens, sampling)
        tokens, first = _left_padded(prompts, self.batch_size, bucket)
        key = jax.random.key(seed) if isinstance(seed, int) else seed
        with self._rows():
            keys = _row_keys(key, self.batch_size)
        calls = (self._structure, self._weights, first, keys, sampling.values(), sampling.filters)
        return self._steps(rows, tokens, max_new_tokens, calls, frozenset(eos), stop)

    def _steps(self, rows, tokens, max_new_tokens, calls, eos, stop) -> Iterator[list[Token]]:
        structure, weights, first, keys, controls, filters = calls
        with self._rows():  # entered per call: the caller's context is its own between steps
            token, logprob, self._cache = _prefill(
                structure, weights, self._cache, tokens, first, keys, controls, filters
            )
        going = set(range(rows))
        written: list[list[int]] = [[] for _ in range(rows)]
        for step in range(max_new_tokens):
            current = (token, logprob)
            if step + 1 < max_new_tokens:  # dispatched before the host waits for `current`
                index = np.int32(tokens.shape[1] + step)
                with self._rows():
                    token, logprob, self._cache = _decode(
                        structure, weights, self._cache, token, index, first, keys, step + 1,
                        controls, filters,
                    )  # fmt: skip
            chosen, chosen_logprob = (np.asarray(a) for a in current)
            out = [Token(r, int(chosen[r]), float(chosen_logprob[r])) for r in sorted(going)]
            for t in out:
                written[t.row].append(t.token)
                if t.token in eos or (stop is not None and stop(t.row, written[t.row])):
                    going.discard(t.row)
            yield out
            if not going:
                return

    def _rows(self) -> contextlib.AbstractContextManager:
        """How the batch's rows lie on the mesh: over its batch axes where the session is
        `split` (a batch they divide), else whole on every device."""
        return contextlib.nullcontext() if self.split else unsplit_batch()

    def generate(
        self,
        prompts: Sequence[np.ndarray],
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        seed: int | jax.Array = 0,
        eos: Sequence[int] = (),
        stop: Callable[[int, list[int]], bool] | None = None,
        logprobs: bool = False,
    ) -> list[Completion]:
        """Every row's `Completion` (see `stream`)."""
        done = [Completion([], [] if logprobs else None) for _ in prompts]
        eos = frozenset(eos)
        for step in self.stream(prompts, max_new_tokens, sampling, seed, eos, stop):
            for t in step:
                row = done[t.row]
                if t.token in eos:
                    row.finish = "eos"
                    continue
                row.tokens.append(t.token)
                if logprobs:
                    row.logprobs.append(t.logprob)
                if stop is not None and stop(t.row, row.tokens):
                    row.finish = "stop"
        return done

    def _checked(self, prompts, max_new_tokens: int, sampling: Sampling) -> tuple[int, int]:
        """(rows, bucket) of a call, refused by name where it cannot run."""
        model, rows = self.model, len(prompts)
        if not 1 <= rows <= self.batch_size:
            raise ZooError(
                f"{rows} prompts for a generation session of {self.batch_size} rows: give "
                f"between 1 and {self.batch_size}."
            )
        longest = max(len(p) for p in prompts)
        if min(len(p) for p in prompts) < 1:
            raise ZooError("An empty prompt: give every prompt at least one token.")
        if longest + max_new_tokens > model.context_length or max_new_tokens < 1:
            raise ZooError(
                f"max_new_tokens={max_new_tokens} must lie between 1 and context_length - "
                f"{longest} = {model.context_length - longest}: prompt and new tokens share the "
                f"model's {model.context_length} positions (the longest prompt has {longest})."
            )
        bucket = prompt_bucket(longest, model.context_length)
        if bucket + max_new_tokens - 1 > self.slots:
            raise ZooError(
                f"A prompt padded to {bucket} tokens and {max_new_tokens} new ones need "
                f"{bucket + max_new_tokens - 1} cache slots; this session has {self.slots}."
            )
        sampling.check(model.vocab_size)
        return rows, bucket


def require_language_model(model: Any) -> None:
    if not all(hasattr(model, n) for n in ("decode", "empty_cache", "vocab_size")):
        raise ZooError(
            f"zoo.generate needs a language model with a key/value cache (gpt, decoder), got "
            f"{type(model).__name__}."
        )


def prompt_bucket(length: int, context_length: int) -> int:
    """The length a prompt of `length` tokens is padded to: a power of two from
    `SMALLEST_BUCKET`, at most the context."""
    return min(max(SMALLEST_BUCKET, 1 << (length - 1).bit_length()), context_length)


def session_for(
    model: Any, prompts: Sequence[np.ndarray], max_new_tokens: int, split: bool = False
) -> Session:
    """A session that fits these prompts: a row each, and a cache of a power of two slots
    (from 64) that holds the longest prompt's bucket and the new tokens."""
    longest = max((len(p) for p in prompts), default=1)
    bucket = prompt_bucket(max(longest, 1), model.context_length)
    slots = max(64, 1 << (bucket + max_new_tokens - 1).bit_length())
    return Session(model, len(prompts), slots, split)


def sample_completions(
    model: Any,
    prompts: Sequence[np.ndarray],
    max_new_tokens: int,
    sampling: Mapping[str, float],
    key: jax.Array,
    eos: Sequence[int],
) -> list[tuple[list[int], bool]]:
    """The language models' `sample` (`zoo.engine.registry.Sample`): each prompt's new ids,
    drawn in one session, the id of `eos` that ended it last, and whether one did. The rows
    are split over the mesh's batch axes where those divide them (a training batch of
    completions), as a training step's are."""
    split = len(prompts) % _batch_shards() == 0
    session = session_for(model, prompts, max_new_tokens, split)
    ends = frozenset(eos)
    written: list[list[int]] = [[] for _ in prompts]
    for step in session.stream(prompts, max_new_tokens, Sampling(**sampling), key, ends):
        for token in step:
            written[token.row].append(token.token)
    return [(new, bool(new) and new[-1] in ends) for new in written]


def _batch_shards() -> int:
    """The devices the active mesh splits a batch's rows over."""
    axes = logical_spec("batch")[0] or ()
    mesh = jax.sharding.get_abstract_mesh()
    return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def _left_padded(prompts, batch_size: int, bucket: int) -> tuple[np.ndarray, np.ndarray]:
    """The prompts right-aligned in a batch x bucket array of token ids (rows past the prompts
    a single token), and each row's first real slot."""
    tokens = np.zeros((batch_size, bucket), np.int32)
    first = np.full(batch_size, bucket - 1, np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, bucket - len(prompt) :] = prompt
        first[row] = bucket - len(prompt)
    return tokens, first


def _row_keys(key: jax.Array, batch_size: int) -> jax.Array:
    return jax.vmap(lambda row: jax.random.fold_in(key, row))(jnp.arange(batch_size))


class Structure:
    """A model's (graphdef, treedef), a static argument of the compiled steps, with its hash
    taken once: jit hashes its static arguments at every call, and a 28-layer model's graphdef
    took about 27 ms to hash, as long as a decoding step's work at one row."""

    def __init__(self, value: tuple):
        self.value, self._hash = value, hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, Structure) and self._hash == other._hash and self.value == other.value
        )


def _model(structure: Structure, weights):
    graphdef, treedef = structure.value
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, weights[0]))
    model.eval()
    return model


@functools.partial(jax.jit, static_argnames=("structure", "filters"), donate_argnames=("cache",))
def _prefill(structure, weights, cache, tokens, first, keys, controls, filters):
    COMPILATIONS["prefill", *tokens.shape, _length(cache), filters] += 1
    log.debug("compiling the prefill of %d x %d tokens (%s)", *tokens.shape, ",".join(filters))
    logits, cache = prefilled(structure, weights, cache, tokens, first)
    return (*choose(logits, step_keys(keys, 0), controls, filters), cache)


def prefilled(structure, weights, cache, tokens, first) -> tuple[jax.Array, Any]:
    """(Traced.) The next-token logits (batch x vocabulary) after each left-padded prompt of
    `tokens`, its first real slot at `first`, and the cache filled with them from slot 0."""
    tokens, first = jax.sharding.reshard(tokens, P()), jax.sharding.reshard(first, P())
    slots = Slots(jnp.int32(0), first, prefill=True)
    # Left-padded: the last column is every row's last prompt token.
    with reading_widened(*weights):
        logits, cache = _model(structure, weights).decode(tokens, cache, slots, last_only=True)
    return logits[:, -1], cache


def decoded(structure, weights, cache, token, index, first) -> tuple[jax.Array, Any]:
    """(Traced.) The next-token logits (batch x vocabulary) after each row's `token` written at
    slot `index` (a scalar, or one per row), and the cache with it."""
    first = jax.sharding.reshard(first, P())
    slots = Slots(index, first, prefill=False)
    with reading_widened(*weights):
        logits, cache = _model(structure, weights).decode(token[:, None], cache, slots)
    return logits[:, 0], cache


@functools.partial(jax.jit, static_argnames=("structure", "filters"), donate_argnames=("cache",))
def _decode(structure, weights, cache, token, index, first, keys, step, controls, filters):
    COMPILATIONS["decode", token.shape[0], _length(cache), filters] += 1
    log.debug("compiling the decode step of %d rows (%s)", token.shape[0], ",".join(filters))
    logits, cache = decoded(structure, weights, cache, token, index, first)
    return (*choose(logits, step_keys(keys, step), controls, filters), cache)


def _length(cache) -> int:
    return max(leaf.shape[-3] for leaf in jax.tree.leaves(cache))


def step_keys(keys: jax.Array, step) -> jax.Array:
    """Each row's key for its new token number `step` (a scalar, or one per row)."""
    per_row = 0 if jnp.ndim(step) else None
    return jax.vmap(jax.random.fold_in, in_axes=(0, per_row))(keys, step)


def choose(
    logits: jax.Array, keys: jax.Array, controls: dict, filters: tuple[str, ...]
) -> tuple[jax.Array, jax.Array]:
    """Each row's next token (int32) from its logits (batch x vocabulary) as `Sampling` says,
    and its log-probability under the unfiltered distribution. Each control is a scalar or
    one value per row."""
    logits = jax.sharding.reshard(logits.astype(jnp.float32), P())  # the vocabulary whole
    if filters == ("greedy",):
        token = jnp.argmax(logits, axis=-1)
    else:
        allowed = filtered(logits / _column(controls["temperature"]), controls, filters)
        token = jax.vmap(jax.random.categorical)(keys, allowed)
    token = token.astype(jnp.int32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    return token, jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]


def filtered(scaled: jax.Array, controls: dict, filters: tuple[str, ...]) -> jax.Array:
    """`scaled` logits with those outside top-k, top-p and min-p set to -inf."""
    cut = jnp.asarray(-jnp.inf, scaled.dtype)
    if "top_k" in filters or "top_p" in filters:
        ordered = -jnp.sort(-scaled, axis=-1)  # likeliest first
        if "top_k" in filters:
            top_k = jnp.broadcast_to(_column(controls["top_k"]), (scaled.shape[0], 1))
            kth = jnp.take_along_axis(ordered, top_k - 1, axis=-1)
            scaled = jnp.where(scaled >= kth, scaled, cut)
            ordered = jnp.where(jnp.arange(ordered.shape[-1]) < top_k, ordered, cut)
        if "top_p" in filters:
            probs = jax.nn.softmax(ordered, axis=-1)
            before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the likelier tokens
            kept = jnp.sum(before < _column(controls["top_p"]), axis=-1, keepdims=True)
            least = jnp.take_along_axis(ordered, kept - 1, axis=-1)
            scaled = jnp.where(scaled >= least, scaled, cut)
    if "min_p" in filters:
        probs = jax.nn.softmax(scaled, axis=-1)
        floor = _column(controls["min_p"]) * jnp.max(probs, axis=-1, keepdims=True)
        scaled = jnp.where(probs >= floor, scaled, cut)
    return scaled


def _column(control: jax.Array) -> jax.Array:
    """A control, scalar or one per row, as a column against batch x vocabulary."""
    return jnp.reshape(control, (-1, 1))

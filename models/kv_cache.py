"""The key/value cache that language models decode against, shared by `gpt` and `decoder`.

A batch of prompts of different lengths is left-padded to one length, so that every row writes
its next token into the same slot of the cache: one `dynamic_update_slice` for the whole batch,
in place when the cache is donated. What differs between rows is where their real tokens start
(`Slots.first`): a row's positions count from there, and the slots before it are never seen.
A row decoded in a batch thus sees exactly the keys, values and positions it would see alone.
Rows that joined a running batch at different times (continuous batching,
`zoo.models.serving_engine`) are each at a slot of their own: `Slots.index` then holds one slot
per row, and a decode step writes each row's token at its own (`write_row` places a prompt
prefilled alone into its row).

Each layer's cache is `slots` long, a sliding-window layer's only its window (when that is
shorter): slot `s` of a cache of `S` slots holds the latest token whose slot index is `s`
modulo `S` (a ring buffer), so a window's memory is bounded by the window however long the
text grows. A full-attention layer's cache is as long as the text, so it never wraps.

A prefill (`Slots.prefill`) runs a whole left-padded prompt from slot 0: the tokens attend
among themselves, and the cache keeps their keys and values (a ring its last `S`). A decode
step runs one token per row at `Slots.index`, attending to the cache: a layer whose cache never
wraps attends to its slots up to the shortest of `written_lengths` that holds the step's tokens,
not to all of them (`over_written_slots`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

KVCache = tuple[jax.Array, jax.Array]
"""Keys and values of one layer: two arrays of batch x slots x heads x head_dim (with a
leading layer axis for stacked layers)."""
Cache = tuple[KVCache, ...] | KVCache
"""A language model's key/value cache: one (keys, values) pair per layer, or one pair of
stacked arrays for stacked layers (`scan_layers`)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Slots:
    """Where the new tokens of a call go. `index`: the slot of the first new token (int32: a
    scalar, the same for every row, 0 in a prefill; or one per row, where rows that joined a
    running batch at different times are at different slots: `zoo.models.serving_engine`);
    `first`: each row's first real slot (int32, batch), the slots before it its left padding;
    `prefill`: the new tokens are a whole prompt from slot 0."""

    index: jax.Array
    first: jax.Array
    prefill: bool = dataclasses.field(metadata={"static": True})

    def queries(self, length: int) -> jax.Array:
        """The slots of the new tokens (1 or batch x length, int32)."""
        return jnp.reshape(self.index, (-1, 1)) + jnp.arange(length, dtype=jnp.int32)

    def positions(self, length: int) -> jax.Array:
        """The positions (batch x length, int32) of the new tokens in their own rows: their
        distance from the row's first real slot (0 for padding)."""
        return jnp.maximum(self.queries(length) - self.first[:, None], 0)


class DecodesWithCache:
    """A language model's `decode`, for a model whose `_forward(tokens, key, cache, slots,
    last_only=...)` runs its layers against the cache (gpt's, the decoder's)."""

    def decode(
        self, tokens: jax.Array, cache: Any, slots: Slots, last_only: bool = False
    ) -> tuple[jax.Array, Any]:
        """Logits for `tokens` placed at `slots` (`last_only`: for the last of each row only,
        all a prefill needs), attending to the cache's earlier slots; the cache comes back with
        these tokens' keys and values in it."""
        return self._forward(tokens, jax.random.key(0), cache, slots, last_only=last_only)


def empty_cache(
    batch_size: int,
    slots: int,
    heads: tuple[int, int],
    *,
    dtype: Any,
    spec: P,
    windows: Sequence[int],
    stacked: bool,
    value_width: int | None = None,
) -> Cache:
    """A language model's empty key/value cache (zeros) for `decode`, a (keys, values) pair
    for each layer of `windows` (its sliding window; 0: none): `batch_size` rows x `slots`
    positions (a sliding layer's at most its window: a ring buffer) x `heads` (heads,
    head_dim), laid out as `spec` (of batch, slots, heads, head_dim) says. `stacked` layers
    (`scan_layers`) have one pair of arrays with a leading layer axis, every layer `slots`
    long. `value_width`: the values' features where they differ from the keys' (latent
    attention's cache holds latents as keys and rotated keys as values)."""
    value_heads = heads if value_width is None else (heads[0], value_width)

    def zeros(length: int, shape: tuple[int, int], *layers: int) -> jax.Array:
        sharding = P(*(None,) * len(layers), *spec)
        return jnp.zeros((*layers, batch_size, length, *shape), dtype, out_sharding=sharding)

    if stacked:
        return zeros(slots, heads, len(windows)), zeros(slots, value_heads, len(windows))
    lengths = (cache_slots(slots, window) for window in windows)
    return tuple((zeros(length, heads), zeros(length, value_heads)) for length in lengths)


def cache_slots(total: int, window: int) -> int:
    """How many slots a layer keeps for a text of `total` slots: its window, when it has a
    shorter one."""
    return min(window, total) if window else total


def update(cache: KVCache, k: jax.Array, v: jax.Array, slots: Slots, window: int):
    """The keys and values the new tokens attend to, which of them each new token sees
    (batch x new x keys, boolean), and the layer's cache with the new keys and values in it.
    `window`: a sliding window's length (0: none)."""
    length, size = k.shape[1], cache[0].shape[1]
    queries = slots.queries(length)  # 1 or batch x length
    if slots.prefill:
        written = (_fill(cache[0], k), _fill(cache[1], v))
        keys, values, held = k, v, jnp.arange(length, dtype=jnp.int32)[None]
    else:
        at = jnp.reshape(slots.index % size, (-1,))
        written = tuple(_written(c, x, at) for c, x in ((cache[0], k), (cache[1], v)))
        keys, values = written
        # The slot index each cache slot holds: the latest one up to the last new token.
        last = queries[:, -1:]
        held = last - (last - jnp.arange(size, dtype=jnp.int32)) % size
    distance = queries[:, :, None] - held[:, None, :]
    seen = (distance >= 0) & ((distance < window) if window else True)
    real = held[:, None, :] >= slots.first[:, None, None]
    # A padding token sees itself, so that no row of the softmax is empty.
    visible = (seen & real) | (distance == 0)
    return keys, values, visible, written


def _fill(cache: jax.Array, x: jax.Array) -> jax.Array:
    """The cache after a prefill of `x` (batch x length x ...) from slot 0: all of it where it
    fits, else its last `slots` in their ring slots."""
    length, size = x.shape[1], cache.shape[1]
    if length <= size:
        return _written(cache, x, 0)
    return jnp.roll(x[:, length - size :].astype(cache.dtype), (length - size) % size, axis=1)


def _written(cache: jax.Array, x: jax.Array, at: jax.Array | int, axis: int = 1) -> jax.Array:
    """`cache` with `x` written from slot `at` on (along `axis`), in place; `at` with one slot
    per row (a 1-D array of more than one) writes each row at its own. A bfloat16 cache is
    written through its bits (uint16, the same bits): XLA:CPU widens a bfloat16
    `dynamic_update_slice` to float32 over the whole cache, a copy of all of it at every
    step."""
    x = x.astype(cache.dtype)
    if jnp.ndim(at) == 1 and jnp.shape(at)[0] > 1:
        write = jax.vmap(lambda c, y, a: jax.lax.dynamic_update_slice_in_dim(c, y, a, axis - 1))
    else:
        at = jnp.reshape(at, ())
        write = functools.partial(jax.lax.dynamic_update_slice_in_dim, axis=axis)
    if cache.dtype != jnp.bfloat16:
        return write(cache, x, at)
    bits = (jax.lax.bitcast_convert_type(a, jnp.uint16) for a in (cache, x))
    return jax.lax.bitcast_convert_type(write(*bits, at), jnp.bfloat16)


def write_row(cache: Any, row_cache: Any, row: jax.Array) -> Any:
    """`cache` (a language model's, of many rows) with the one-row cache `row_cache` written
    into its row `row`, in place when donated: how a prompt prefilled alone joins a running
    batch."""

    def one(pool: jax.Array, new: jax.Array) -> jax.Array:
        return _written(pool, new, row, axis=pool.ndim - 4)  # batch x slots x heads x dim

    return jax.tree.map(one, cache, row_cache)


SHORTEST_READ = 64
"""The fewest slots a decode step attends to: shorter reads save less than a branch costs."""


def written_lengths(size: int) -> list[int]:
    """The lengths of the cache's first slots a decode step may attend to: powers of two from
    `SHORTEST_READ`, and the whole cache."""
    lengths = [SHORTEST_READ]
    while lengths[-1] < size:
        lengths.append(lengths[-1] * 2)
    return [length for length in lengths if length < size] + [size]


Attend = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
"""(keys, values, visible) -> the attention of the step's queries to them."""


def over_written_slots(
    attend: Attend,
    keys: jax.Array,
    values: jax.Array,
    visible: jax.Array,
    slots: Slots,
    window: int,
) -> jax.Array:
    """`attend(keys, values, visible)` (`update`'s, `visible` with a heads axis) over the slots
    that hold tokens so far. A decode step of a layer whose cache never wraps (no window) reads
    only the first of `written_lengths` slots that holds its last new token: each length is a
    branch of the one compiled step, chosen as it runs (`lax.switch`), so a session still
    compiles one decode step, and a step early in a long cache reads a fraction of it. The
    slots left out are ones no token sees (their softmax weight exactly zero)."""
    lengths = written_lengths(keys.shape[1])
    if slots.prefill or window or len(lengths) == 1:
        return attend(keys, values, visible)
    last = jnp.max(slots.index) + visible.shape[-2] - 1
    which = jnp.searchsorted(jnp.asarray(lengths, jnp.int32), last, side="right")
    branches = [functools.partial(_first_slots, attend, length) for length in lengths]
    return jax.lax.switch(which, branches, keys, values, visible)


def _first_slots(attend: Attend, length: int, keys, values, visible) -> jax.Array:
    return attend(keys[:, :length], values[:, :length], visible[..., :length])

"""zoo.models.kv_cache.over_written_slots: a decode step of a layer whose cache never wraps
attends to the first of `written_lengths` slots that holds its token, chosen as the one
compiled step runs, and computes what attending to the whole cache computes; a prefill and a
sliding-window layer attend to all of it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from zoo.models import kv_cache
from zoo.models.kv_cache import Slots

BATCH, SLOTS, HEADS, FEATURES = 3, 256, 2, 8


def test_the_lengths_are_powers_of_two_from_the_shortest_read_and_the_whole_cache():
    assert kv_cache.written_lengths(256) == [64, 128, 256]
    assert kv_cache.written_lengths(200) == [64, 128, 200]
    assert kv_cache.written_lengths(64) == [64]
    assert kv_cache.written_lengths(16) == [16]


def softmax_attention(q):
    def attend(keys, values, visible):
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, keys)
        logits = jnp.where(visible, logits, -1e30)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), values)

    return attend


@pytest.fixture(scope="module")
def step():
    """A decode step's attention at slot `index` over a cache of SLOTS slots, rows whose real
    tokens start at different slots: (through `over_written_slots`, over the whole cache, the
    key lengths the attention was traced with)."""
    keys = jax.random.split(jax.random.key(0), 4)
    cache = tuple(jax.random.normal(k, (BATCH, SLOTS, HEADS, FEATURES)) for k in keys[:2])
    new = tuple(jax.random.normal(k, (BATCH, 1, HEADS, FEATURES)) for k in keys[2:])
    q = new[0] * 0.5
    first = jnp.asarray([0, 5, 30], jnp.int32)
    traced = set()

    def attend_to(index, read_written: bool):
        slots = Slots(index, first, prefill=False)
        k, v, visible, _ = kv_cache.update(cache, *new, slots, 0)
        visible = visible[:, None]
        attend = softmax_attention(q)

        def recorded(k, v, visible):
            traced.add(k.shape[1])
            return attend(k, v, visible)

        if read_written:
            return kv_cache.over_written_slots(recorded, k, v, visible, slots, 0)
        return attend(k, v, visible)

    read = jax.jit(lambda index: attend_to(index, True))
    whole = jax.jit(lambda index: attend_to(index, False))
    return read, whole, traced


@pytest.mark.parametrize("index", [40, 63, 64, 127, 128, 200, 255])
def test_a_decode_step_computes_what_attending_to_the_whole_cache_does(step, index):
    read, whole, traced = step
    index = jnp.int32(index)
    np.testing.assert_allclose(np.asarray(read(index)), np.asarray(whole(index)), atol=1e-6)
    assert traced == {64, 128, 256}  # one compiled step holds every length


def test_a_step_reads_the_shortest_length_that_holds_its_token():
    seen = []

    def attend(k, v, visible):
        jax.debug.callback(lambda n: seen.append(int(n)), jnp.int32(k.shape[1]))
        return jnp.zeros((1, 1, 1, 1))

    cache = jnp.zeros((1, 256, 1, 1))
    visible = jnp.ones((1, 1, 1, 256), bool)
    step = jax.jit(
        lambda index: kv_cache.over_written_slots(
            attend, cache, cache, visible, Slots(index, jnp.zeros(1, jnp.int32), False), 0
        )
    )
    for index in (0, 63, 64, 127, 128, 255):
        step(jnp.int32(index)).block_until_ready()
    assert seen == [64, 64, 128, 128, 256, 256]


@pytest.mark.parametrize(("prefill", "window"), [(True, 0), (False, 16)])
def test_a_prefill_or_a_sliding_window_layer_attends_to_the_whole_cache(prefill, window):
    lengths = []

    def attend(k, v, visible):
        lengths.append(k.shape[1])
        return k

    cache = jnp.zeros((1, 256, 1, 1))
    slots = Slots(jnp.int32(70), jnp.zeros(1, jnp.int32), prefill)
    kv_cache.over_written_slots(attend, cache, cache, jnp.ones((1, 1, 1, 256)), slots, window)
    assert lengths == [256]


def test_a_bfloat16_cache_is_written_in_place_with_the_same_bits():
    """Not widened to float32 over the whole cache (which XLA:CPU does to a bfloat16
    `dynamic_update_slice`): a step writes its slot and copies nothing else."""
    cache = tuple(
        jax.random.normal(jax.random.key(i), (2, 64, 2, 8)).astype(jnp.bfloat16) for i in range(2)
    )
    new = jax.random.normal(jax.random.key(3), (2, 1, 2, 8))  # float32, written as bfloat16
    slots = Slots(jnp.int32(9), jnp.zeros(2, jnp.int32), prefill=False)

    def step(cache, new):
        return kv_cache.update(cache, new, new, slots, 0)[3]

    written = jax.jit(step, donate_argnums=0)
    text = written.lower(cache, new).compile().as_text()
    assert "f32[2,64,2,8]" not in text
    want = [c.at[:, 9:10].set(new.astype(jnp.bfloat16)) for c in cache]
    got = written(cache, new)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


@pytest.mark.parametrize(("length", "window"), [(SLOTS, 0), (16, 16)])
def test_rows_at_slots_of_their_own_compute_what_each_computes_alone(length, window):
    """`Slots.index` one per row (rows that joined a running batch at different times): each
    row writes its token at its own slot, a ring's too, and attends as it does when the whole
    batch is at its slot."""
    keys = jax.random.split(jax.random.key(1), 4)
    cache = tuple(jax.random.normal(k, (BATCH, length, HEADS, FEATURES)) for k in keys[:2])
    new = tuple(jax.random.normal(k, (BATCH, 1, HEADS, FEATURES)) for k in keys[2:])
    first = jnp.asarray([0, 5, 30], jnp.int32)

    @jax.jit
    def attended(index):
        slots = Slots(index, first, prefill=False)
        k, v, visible, written = kv_cache.update(cache, *new, slots, window)
        attend = softmax_attention(new[0])
        return kv_cache.over_written_slots(attend, k, v, visible[:, None], slots, window), written

    index = jnp.asarray([40, 100, 200], jnp.int32)
    together, written = attended(index)
    for row in range(BATCH):
        alone, alone_written = attended(index[row])
        np.testing.assert_allclose(together[row], alone[row], atol=1e-6)
        for a, b in zip(written, alone_written, strict=True):
            np.testing.assert_array_equal(a[row], b[row])

"""The CPU's written-out attention (`zoo.engine.kernels.attention_cpu`) computes what
`jax.nn.dot_product_attention` does, forward and backward: causal in blocks of queries (lengths
that the blocks divide and that they do not), bidirectional, another scale, bfloat16, and with
batch and heads split over a mesh; and the shared block takes it on a CPU. A decoding step's
attention (`attend_one`: one query a row against a cache) is the masked softmax of that query,
grouped heads and soft-capped logits included, and `attend` takes it for a decoding step where
its heads are grouped or held in half precision."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance.checks import MESH, ONE_DEVICE, on_mesh
from jax.sharding import PartitionSpec as P
from zoo.engine.kernels import attention, attention_cpu
from zoo.engine.sharding.mesh import logical_spec

BATCH, HEADS, HEAD_DIM = 4, 2, 8  # the batch splits 4 ways, the heads 2


def qkvw(length: int, dtype=jnp.float32) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.key(length), 4)
    return tuple(jax.random.normal(k, (BATCH, length, HEADS, HEAD_DIM)).astype(dtype) for k in keys)


def value_and_grads(attend, q, k, v, w):
    """The attention and the gradients of a weighted sum of it with respect to q, k and v."""

    def objective(q, k, v):
        mixed = attend(q, k, v)
        return jnp.sum(mixed.astype(jnp.float32) * w.astype(jnp.float32)), mixed

    (_, mixed), grads = jax.jit(jax.value_and_grad(objective, (0, 1, 2), has_aux=True))(q, k, v)
    return [np.asarray(x, np.float32) for x in (mixed, *grads)]


def both(q, k, v, w, causal, scale=None):
    def ours(q, k, v):
        return attention_cpu.attend(q, k, v, scale=scale, causal=causal)

    def jax_kernel(q, k, v):
        return jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=causal, implementation="xla"
        )

    return value_and_grads(ours, q, k, v, w), value_and_grads(jax_kernel, q, k, v, w)


@pytest.mark.parametrize(
    "length, causal, scale",
    [(256, True, None), (200, True, None), (130, True, 1.0), (40, True, None), (130, False, None)],
    ids=["4-blocks", "3-uneven-blocks", "2-blocks-scale-1", "one-block", "bidirectional"],
)
def test_matches_jax_attention_forward_and_backward(length, causal, scale):
    ours, reference = both(*qkvw(length), causal, scale)
    for got, want in zip(ours, reference, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_bfloat16_matches_jax_attention_to_bfloat16_rounding():
    ours, reference = both(*qkvw(130, jnp.bfloat16), causal=True)
    for got, want in zip(ours, reference, strict=True):
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)


def test_batch_and_heads_split_over_a_mesh_give_the_one_device_result():
    q, k, v, _ = qkvw(130)
    whole = attention_cpu.attend(q, k, v, scale=None, causal=True)
    with on_mesh(MESH):
        spec = logical_spec("batch", None, "heads", None)
        split = [jax.sharding.reshard(t, spec) for t in (q, k, v)]
        mixed = jax.jit(lambda q, k, v: attention_cpu.attend(q, k, v, scale=None, causal=True))(
            *split
        )
        assert jax.typeof(mixed).sharding.spec == P(*spec)
    np.testing.assert_allclose(np.asarray(mixed), np.asarray(whole), rtol=1e-6, atol=1e-6)


def test_the_shared_block_takes_it_on_a_cpu_without_a_cache(monkeypatch):
    from flax import nnx
    from zoo.models.gpt import GPT

    calls = []
    attend = attention_cpu.attend

    def counted(*args, **kwargs):
        calls.append(kwargs["causal"])
        return attend(*args, **kwargs)

    monkeypatch.setattr(attention_cpu, "attend", counted)
    with on_mesh({"data": 1, "fsdp": 1, "tensor": 1}):
        model = GPT(context_length=16, dim=16, depth=2, num_heads=2, rngs=nnx.Rngs(0))
        model(jnp.zeros((1, 16), jnp.int32))
    assert calls == [True, True]


@pytest.mark.parametrize(
    ("heads", "kv_heads", "softcap", "dtype"),
    [
        (4, 4, 0.0, jnp.float32),
        (4, 2, 0.0, jnp.float32),
        (4, 1, 5.0, jnp.float32),
        (4, 2, 0.0, jnp.bfloat16),
    ],
    ids=["heads", "grouped", "one-kv-head-softcapped", "bf16"],
)
def test_a_decoding_step_s_attention_is_the_masked_softmax_of_its_one_query(
    heads, kv_heads, softcap, dtype
):
    """`attend_one`: one query a row against a cache of 40 slots, rows seeing different slots,
    key/value heads shared by groups of query heads, logits soft-capped; against the same
    attention written out in float64."""
    keys = jax.random.split(jax.random.key(heads + kv_heads), 3)
    q = jax.random.normal(keys[0], (3, 1, heads, HEAD_DIM)).astype(dtype)
    k, v = (jax.random.normal(key, (3, 40, kv_heads, HEAD_DIM)).astype(dtype) for key in keys[1:])
    first = np.array([0, 7, 39])
    visible = jnp.asarray((np.arange(40)[None] >= first[:, None])[:, None, None])
    got = attention_cpu.attend_one(q, k, v, visible, scale=0.3, softcap=softcap)
    assert got.shape == q.shape and got.dtype == dtype
    q64, k64, v64 = (np.asarray(t, np.float64) for t in (q, k, v))
    k64, v64 = (np.repeat(t, heads // kv_heads, axis=2) for t in (k64, v64))
    logits = np.einsum("bqhd,bkhd->bhqk", q64, k64) * 0.3
    if softcap:
        logits = softcap * np.tanh(logits / softcap)
    logits = np.where(np.asarray(visible), logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    want = np.einsum("bhqk,bkhd->bqhd", weights, v64)
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tolerance)


def test_a_decoding_step_takes_attend_one_where_its_heads_are_grouped_or_half_precision(
    monkeypatch,
):
    calls = []
    attend_one = attention_cpu.attend_one

    def counted(*args, **kwargs):
        calls.append(True)
        return attend_one(*args, **kwargs)

    monkeypatch.setattr(attention_cpu, "attend_one", counted)

    def taken(heads, kv_heads, dtype=jnp.float32, queries=1, cached=True):
        calls.clear()
        q = jnp.ones((1, queries, heads, HEAD_DIM), dtype)
        k = v = jnp.ones((1, 8, kv_heads, HEAD_DIM), dtype)
        mask = jnp.ones((1, 1, queries, 8), bool) if cached else None
        mixed = attention.attend(q, k, v, causal=True, cache_mask=mask)
        np.testing.assert_allclose(np.asarray(mixed, np.float32), 1.0)  # the mean of ones
        return bool(calls)

    with on_mesh(ONE_DEVICE):
        assert taken(4, 2) and taken(4, 4, jnp.bfloat16)
        assert not taken(4, 4)  # float32, a key/value head each: jax's product is faster there
        assert not taken(4, 2, queries=2) and not taken(4, 2, cached=False)
    with on_mesh(MESH):
        assert not taken(4, 2)

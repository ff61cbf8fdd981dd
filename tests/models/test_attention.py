"""The shared block's attention (`zoo.engine.kernels.attention.attend`) computes what attention
written out in einsums does: causal, bidirectional and against a KV cache, on one device and
with heads split over `tensor`; and each call takes the kernel and mask `route` picks for it,
in the order `attend` documents."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance.checks import MESH, ONE_DEVICE
from model_checks import Models, outputs
from zoo.engine.kernels.attention import Call, Platform, Route, current_platform, route
from zoo.engine.sharding.mesh import logical_spec
from zoo.models.kv_cache import Slots

CONTEXT, DIM, HEADS, BATCH = 16, 32, 4, 4


@pytest.fixture(scope="module")
def models():
    return Models("gpt", "text", context_length=CONTEXT, dim=DIM, depth=1, num_heads=HEADS)


def written_out(attention, x, cache, start, causal):
    """Attention as three projections, two einsums and a masked softmax."""
    heads = logical_spec("batch", None, "heads", None)
    q, k, v = (p(x, out_sharding=heads) for p in (attention.query, attention.key, attention.value))
    if cache is not None:
        k = jax.lax.dynamic_update_slice_in_dim(cache[0], k, start, axis=1)
        v = jax.lax.dynamic_update_slice_in_dim(cache[1], v, start, axis=1)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        visible = jnp.arange(k.shape[1])[None, :] <= (start + jnp.arange(q.shape[1]))[:, None]
        logits = jnp.where(visible, logits, -jnp.inf)
    mixed = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)
    return attention.out(mixed, out_sharding=logical_spec("batch", None, None))


def both(model, x, cache, start, causal):
    attention = model.blocks[0].attention
    if cache is not None:  # where the model's own cache lives
        spec = logical_spec("batch", None, "heads", None)
        cache = tuple(jax.sharding.reshard(c, spec) for c in cache)
    attention.causal = causal
    rows = jnp.zeros(x.shape[0], jnp.int32)  # no row padded
    slots = None if cache is None else Slots(jnp.int32(start), rows, prefill=False)
    fused, _ = attention(x, jax.random.key(0), cache, slots)
    return fused, written_out(attention, x, cache, start, causal)


@pytest.mark.parametrize("mesh", [ONE_DEVICE, MESH], ids=["one-device", "2x2x2"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_fused_attention_matches_einsum_attention(models, mesh, causal):
    x = jax.random.normal(jax.random.key(1), (BATCH, CONTEXT, DIM))
    model = models.one if mesh is ONE_DEVICE else models.split
    model.eval()
    fused, reference = outputs(model, mesh, lambda m, x: both(m, x, None, 0, causal), x)
    np.testing.assert_allclose(fused, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mesh", [ONE_DEVICE, MESH], ids=["one-device", "2x2x2"])
def test_fused_attention_matches_einsum_attention_against_a_kv_cache(models, mesh):
    head_dim = DIM // HEADS
    keys = jax.random.split(jax.random.key(2), 3)
    x = jax.random.normal(keys[0], (BATCH, 3, DIM))
    cache = tuple(jax.random.normal(k, (BATCH, CONTEXT, HEADS, head_dim)) for k in keys[1:])
    model = models.one if mesh is ONE_DEVICE else models.split
    model.eval()
    fused, reference = outputs(model, mesh, lambda m, x, c: both(m, x, c, 5, True), x, cache)
    np.testing.assert_allclose(fused, reference, rtol=1e-5, atol=1e-6)


HOPPER = Platform("gpu", cuda=True, compute_capability=(9, 0))
AMPERE = Platform("gpu", cuda=True, compute_capability=(8, 0))
CPU = Platform("cpu")
TRAINING = {"causal": True}
DECODING = {"causal": True, "cached": True, "one_query": True}


@pytest.mark.parametrize(
    ("platform", "dtype", "head_dim", "call", "expected"),
    [
        (HOPPER, jnp.bfloat16, 64, TRAINING, Route("cudnn", "causal")),
        (AMPERE, jnp.float16, 128, {"causal": False}, Route("cudnn", "none")),
        (HOPPER, jnp.float32, 64, TRAINING, Route("xla", "causal")),
        (Platform("gpu"), jnp.bfloat16, 64, TRAINING, Route("xla", "causal")),
        (Platform("gpu", True, (7, 5)), jnp.bfloat16, 64, TRAINING, Route("xla", "causal")),
        (HOPPER, jnp.bfloat16, 64, {**TRAINING, "dropout": True}, Route("einsum", "positions")),
        (HOPPER, jnp.bfloat16, 64, {"dropout": True}, Route("einsum", "none")),
        (HOPPER, jnp.bfloat16, 64, {**TRAINING, "softcap": True}, Route("einsum", "positions")),
        (HOPPER, jnp.bfloat16, 64, {**TRAINING, "cached": True}, Route("xla", "positions")),
        (HOPPER, jnp.bfloat16, 64, {**TRAINING, "packed": True}, Route("xla", "causal")),
        (HOPPER, jnp.bfloat16, 64, {**TRAINING, "window": True}, Route("cudnn", "causal")),
        (HOPPER, jnp.bfloat16, 12, TRAINING, Route("xla", "causal")),
        (HOPPER, jnp.bfloat16, 264, TRAINING, Route("xla", "causal")),
        (HOPPER, jnp.bfloat16, 256, TRAINING, Route("cudnn", "causal")),
        (AMPERE, jnp.bfloat16, 256, TRAINING, Route("xla", "causal")),
        (HOPPER, jnp.bfloat16, 64, {**DECODING, "grouped": True}, Route("xla", "positions")),
        (CPU, jnp.float32, 64, TRAINING, Route("cpu", "causal")),
        (CPU, jnp.bfloat16, 64, {"causal": False}, Route("cpu", "none")),
        (CPU, jnp.float32, 64, {**TRAINING, "packed": True}, Route("cpu", "causal")),
        (CPU, jnp.float32, 64, {**TRAINING, "window": True}, Route("xla", "causal")),
        (CPU, jnp.float32, 64, {**TRAINING, "dropout": True}, Route("einsum", "positions")),
        (CPU, jnp.float32, 64, {**TRAINING, "softcap": True}, Route("einsum", "positions")),
        (CPU, jnp.float32, 64, {**TRAINING, "cached": True}, Route("xla", "positions")),
        (CPU, jnp.float32, 64, {**DECODING, "grouped": True}, Route("cpu_decode", "positions")),
        (CPU, jnp.bfloat16, 64, DECODING, Route("cpu_decode", "positions")),
        (CPU, jnp.float32, 64, DECODING, Route("xla", "positions")),
        (
            CPU,
            jnp.float32,
            64,
            {**DECODING, "grouped": True, "softcap": True},
            Route("cpu_decode", "positions"),
        ),
        (
            CPU,
            jnp.float32,
            64,
            {**DECODING, "grouped": True, "dropout": True},
            Route("einsum", "positions"),
        ),
        (
            CPU,
            jnp.bfloat16,
            64,
            {**DECODING, "one_device": False},
            Route("xla", "positions"),
        ),
    ],
    ids=[
        "gpu-bf16-cudnn",
        "gpu-fp16-bidirectional-cudnn",
        "gpu-fp32-xla",
        "rocm-xla",
        "pre-ampere-xla",
        "dropout-einsum",
        "dropout-bidirectional-einsum",
        "softcap-einsum",
        "kv-cache-xla-with-mask",
        "packed-xla",
        "window-cudnn",
        "head-dim-not-multiple-of-8-xla",
        "head-dim-over-256-xla",
        "head-dim-256-on-hopper-cudnn",
        "head-dim-256-before-hopper-xla",
        "gpu-decoding-xla",
        "cpu-kernel",
        "cpu-bidirectional-kernel",
        "cpu-packed-kernel",
        "cpu-window-xla",
        "cpu-dropout-einsum",
        "cpu-softcap-einsum",
        "cpu-kv-cache-xla",
        "cpu-decoding-grouped",
        "cpu-decoding-bf16",
        "cpu-decoding-fp32-heads-each-xla",
        "cpu-decoding-softcap-grouped",
        "cpu-decoding-dropout-einsum",
        "cpu-decoding-on-a-mesh-xla",
    ],
)
def test_route_picks_each_kernel_where_it_runs(platform, dtype, head_dim, call, expected):
    assert route(platform, Call(jnp.dtype(dtype), head_dim, **call)) == expected


def test_this_machine_routes_to_the_cpu_kernel():
    """These tests run on CPUs: the block's calls above took zoo's CPU kernel, or XLA's against
    a cache."""
    assert current_platform() == CPU and jax.default_backend() == "cpu"
    assert route(current_platform(), Call(jnp.dtype(jnp.bfloat16), 64, **TRAINING)) == Route(
        "cpu", "causal"
    )


def causal_both_ways(model, x):
    """XLA's fused attention of the block's own (sharded) queries, keys and values, made causal
    by `is_causal` and by a boolean mask of positions."""
    attention = model.blocks[0].attention
    heads = logical_spec("batch", None, "heads", None)
    q, k, v = (p(x, out_sharding=heads) for p in (attention.query, attention.key, attention.value))
    visible = jnp.tril(jnp.ones((CONTEXT, CONTEXT), bool))[None, None]
    return (
        jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"),
        jax.nn.dot_product_attention(q, k, v, mask=visible, implementation="xla"),
    )


@pytest.mark.parametrize("mesh", [ONE_DEVICE, MESH], ids=["one-device", "2x2x2"])
def test_is_causal_computes_what_the_causal_mask_does(models, mesh):
    x = jax.random.normal(jax.random.key(3), (BATCH, CONTEXT, DIM))
    model = models.one if mesh is ONE_DEVICE else models.split
    by_flag, by_mask = outputs(model, mesh, causal_both_ways, x)
    np.testing.assert_array_equal(by_flag, by_mask)

"""The modern decoder (what every model passes is tests/conformance/): its attention against one
written out in numpy (grouped heads repeated, rotary positions by transformers' formula, the
sliding window as an explicit mask), grouped-query attention equal to multi-head attention with
the key/value heads repeated, RoPE scalings as transformers computes them, decoding against the
cache equal to the full forward pass (past a sliding window too), scanned layers equal to the
layer loop, the same loss on one device and on the 2x2x2 mesh, bfloat16 params, and every bad
hyper-parameter refused by name."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance.checks import MESH, ONE_DEVICE, make_mesh, on_one_device, tiny_hparams
from flax import nnx
from zoo.data.text import TOKENS
from zoo.engine.registry import get_data
from zoo.engine.sharding import mesh as sharding
from zoo.engine.sharding.mesh import DEFAULT_RULES
from zoo.models.decoder_parts import Attention, LayerOptions
from zoo.models.expert_load import expert_load
from zoo.models.kv_cache import Slots
from zoo.models.rope import Rope, inverse_frequencies, rotation

import zoo
from zoo.plugin import MASK, POSITIONS, SEGMENT_IDS, ZooError

RULES = {"kv_heads": "tensor", **DEFAULT_RULES}
"""The default rules, with one for the key/value heads' axis if they lack it."""
SLIDING, FULL = "sliding_attention", "full_attention"
MIXED = {"depth": 3, "sliding_window": 8, "layer_types": [SLIDING, FULL, SLIDING]}
"""Three layers, two of them seeing the last 8 positions only (shorter than the sequences)."""


def activate(mesh=ONE_DEVICE, rules=RULES):
    return sharding.activate(make_mesh(mesh), sharding.AxisRules.from_mapping(rules))


def build(mesh=ONE_DEVICE, rules=RULES, **overrides) -> nnx.Module:
    """The tiny decoder with `overrides`, born on `mesh`."""
    tiny = {k: v for k, v in tiny_hparams("decoder").items() if k != "name"}
    devices = jax.devices()[: math.prod(mesh.values())]
    return zoo.create_model(
        "decoder", mesh={**mesh, "rules": rules}, devices=devices, **{**tiny, **overrides}
    )


@pytest.fixture(scope="module")
def batch() -> dict[str, np.ndarray]:
    """Eight 32-byte windows of the text data set's held-out split."""
    splits = get_data("text").splits({"window": 32})
    return {name: value[:8] for name, value in splits.eval.items()}


def logits(model, tokens, mesh=ONE_DEVICE, rules=RULES) -> np.ndarray:
    with activate(mesh, rules):
        return np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens))


def inputs(batch) -> np.ndarray:
    return batch[TOKENS][:, :-1].astype(np.int32)


# ---- attention against numpy ----------------------------------------------------------------


def numpy_rms(x, scale, epsilon=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + epsilon) * scale


def numpy_rope(x, theta):
    """transformers' default rotary embedding: angles position * inv_freq on both halves,
    x * cos + rotate_half(x) * sin."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    angles = np.arange(x.shape[1])[:, None] * inv_freq[None, :]
    emb = np.concatenate([angles, angles], axis=-1)[None, :, None, :]
    rotated = np.concatenate([-x[..., head_dim // 2 :], x[..., : head_dim // 2]], axis=-1)
    return x * np.cos(emb) + rotated * np.sin(emb)


def numpy_attention(attention, x, window, theta):
    """The layer's attention written out: every key/value head repeated for its group of query
    heads, a query at i seeing keys j with j <= i and i - j < window (0: no window)."""
    param = {k: np.asarray(v[...], np.float64) for k, v in _flat(attention).items()}
    q = np.einsum("btd,nhd->btnh", x, param["query.kernel"])
    k = np.einsum("btd,nhd->btnh", x, param["key.kernel"])
    v = np.einsum("btd,nhd->btnh", x, param["value.kernel"])
    if "query_norm.scale" in param:
        q, k = numpy_rms(q, param["query_norm.scale"]), numpy_rms(k, param["key_norm.scale"])
    q, k = numpy_rope(q, theta), numpy_rope(k, theta)
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    scores = np.einsum("bqnh,bknh->bnqk", q, k) / math.sqrt(q.shape[-1])
    i, j = np.arange(x.shape[1])[:, None], np.arange(x.shape[1])[None, :]
    visible = (j <= i) & ((i - j < window) if window else True)
    scores = np.where(visible, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    mixed = np.einsum("bnqk,bknh->bqnh", weights, v)
    return np.einsum("bqnh,dnh->bqd", mixed, param["out.kernel"])


def _flat(module) -> dict:
    return {
        ".".join(map(str, path)): v for path, v in nnx.to_flat_state(nnx.state(module, nnx.Param))
    }


ATTENTION_CASES = [(4, 0, False), (2, 0, True), (1, 0, False), (2, 1, False), (2, 5, False)]
ATTENTION_CASES += [(1, 5, True), (4, 5, False), (2, 16, False)]
"""(key/value heads of 4 query heads, window, qk_norm): multi-head, grouped and multi-query."""


@pytest.mark.parametrize(
    ("num_kv_heads", "window", "qk_norm"),
    ATTENTION_CASES,
    ids=[f"kv{k}-window{w}{'-qk_norm' * n}" for k, w, n in ATTENTION_CASES],
)
def test_attention_equals_the_explicit_mask_and_repeated_heads(num_kv_heads, window, qk_norm):
    """Against numpy: a window of 1 sees only itself, one of 16 (the sequence's length) is full
    attention; with qk_norm the heads are normalised (random scales) before the rotation."""
    options = LayerOptions(32, 4, num_kv_heads, 8, 64, qk_norm=qk_norm)
    x = np.random.default_rng(0).normal(size=(2, 16, 32)).astype(np.float32)
    theta = 100.0  # turns fast enough that 16 positions see every frequency's effect
    with activate():
        attention = Attention(options, rngs=nnx.Rngs(0))
        if qk_norm:
            for norm in (attention.query_norm, attention.key_norm):
                norm.scale[...] = jax.random.uniform(jax.random.key(1), (8,), minval=0.5)
        angles = rotation(Rope(theta), 8, jnp.arange(16), jnp.float32)

        @nnx.jit
        def call(attention, x):
            return attention(x, angles, window, None, None)[0]

        got = np.asarray(call(attention, x))
    want = numpy_attention(attention, x.astype(np.float64), window, theta)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def grouped():
    """The tiny decoder with 2 key/value heads for its 4 query heads, and with 1, each with
    q/k/v biases (random, so that the repeated biases matter)."""
    models = {kv: build(num_kv_heads=kv, qkv_bias=True) for kv in (1, 2)}
    for model in models.values():
        for path, variable in _flat(model).items():
            if path.endswith("bias"):
                variable[...] = jax.random.normal(jax.random.key(len(path)), variable.shape)
    return models


@pytest.mark.parametrize("num_kv_heads", [1, 2], ids=["mqa", "gqa"])
def test_grouped_query_attention_is_multi_head_with_repeated_kv_heads(grouped, batch, num_kv_heads):
    model = grouped[num_kv_heads]
    multi_head = build(num_kv_heads=4, qkv_bias=True)
    groups = 4 // num_kv_heads
    for path, variable in _flat(multi_head).items():
        value = np.asarray(_flat(model)[path][...])
        if ".key." in path or ".value." in path:  # (kv, head_dim, dim) or (kv, head_dim)
            value = np.repeat(value, groups, axis=0)
        variable[...] = value
    tokens = inputs(batch)
    np.testing.assert_allclose(
        logits(model, tokens), logits(multi_head, tokens), rtol=1e-5, atol=1e-5
    )


# ---- RoPE scalings ----------------------------------------------------------------------------


def transformers_inv_freq(theta, head_dim, kind="default", factor=1.0, low=1.0, high=4.0, old=0):
    """transformers' `modeling_rope_utils` (`_compute_default_rope_parameters`,
    `_compute_linear_scaling_rope_parameters`, `_compute_llama3_parameters`), in float64."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2) / head_dim))
    if kind == "linear":
        return inv_freq / factor
    if kind != "llama3":
        return inv_freq
    low_freq_wavelen, high_freq_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, inv_freq_llama)


ROPES = {
    "default": (Rope(10000.0), 64),
    "qwen3": (Rope(1_000_000.0), 128),
    "linear": (Rope(10000.0, "linear", 8.0), 64),
    "llama3.1": (Rope(500000.0, "llama3", 8.0, 1.0, 4.0, 8192), 128),
    "llama3.2": (Rope(500000.0, "llama3", 32.0, 1.0, 4.0, 8192), 64),
    "llama3-short": (Rope(10000.0, "llama3", 4.0, 2.0, 8.0, 64), 32),
}


@pytest.mark.parametrize("name", ROPES)
def test_rope_frequencies_are_those_of_transformers(name):
    rope, head_dim = ROPES[name]
    old = rope.original_context
    want = transformers_inv_freq(
        rope.theta, head_dim, rope.kind, rope.factor, rope.low_freq_factor,
        rope.high_freq_factor, old,
    )  # fmt: skip
    got = inverse_frequencies(rope, head_dim)
    assert got.dtype == np.float32 and got.shape == (head_dim // 2,)
    np.testing.assert_allclose(got, want, rtol=2e-6)
    if rope.kind == "llama3":  # the three regimes all occur: kept, divided, interpolated
        base = transformers_inv_freq(rope.theta, head_dim)
        ratio = want / base
        assert np.isclose(ratio, 1).any() and np.isclose(ratio, 1 / rope.factor).any()
        assert ((ratio < 1 - 1e-6) & (ratio > 1 / rope.factor + 1e-6)).any()


def test_sliding_layers_rotate_with_their_own_base(batch):
    """local_rope_theta changes the sliding layers' positions only: a model whose layers are
    all full attention computes the same with any local base."""
    tokens = inputs(batch)
    full = {"layer_types": [FULL, FULL]}
    a, b = build(**full, local_rope_theta=100.0), build(**full, local_rope_theta=10.0)
    np.testing.assert_array_equal(logits(a, tokens), logits(b, tokens))
    c, d = build(local_rope_theta=100.0), build(local_rope_theta=10.0)  # sliding, full
    assert not np.allclose(logits(c, tokens), logits(d, tokens), atol=1e-4)


# ---- decoding against the cache; scanned layers --------------------------------------------


def decoded(model, tokens, prompt: int, mesh=ONE_DEVICE, rules=RULES) -> np.ndarray:
    """The logits of a prompt decoded at once, then of each later token one at a time (one
    compiled step for all of them); the sliding layers' caches hold their window only."""
    model.eval()
    step = nnx.jit(lambda model, tokens, cache, slots: model.decode(tokens, cache, slots))
    first = jnp.zeros(tokens.shape[0], jnp.int32)
    with activate(mesh, rules):
        cache = model.empty_cache(tokens.shape[0], tokens.shape[1])
        out, cache = step(model, tokens[:, :prompt], cache, Slots(jnp.int32(0), first, True))
        pieces = [np.asarray(out)]
        for position in range(prompt, tokens.shape[1]):
            token = tokens[:, position : position + 1]
            out, cache = step(model, token, cache, Slots(jnp.int32(position), first, False))
            pieces.append(np.asarray(out))
    return np.concatenate(pieces, axis=1)


LATENT = {"kv_lora_rank": 8, "rope_head_dim": 4, "num_kv_heads": 0}
"""Multi-head latent attention (DeepSeek V3's): each head's 8 features 4 unrotated, 4 rotated;
its cache holds latents of 8 and rotated keys of 4."""


@pytest.mark.parametrize(
    "variant",
    [
        {},
        {"scan_layers": True, "remat": True},
        {"num_kv_heads": 1, "local_rope_theta": 100.0},
        {"attention_softcap": 5.0, "final_softcap": 3.0, "norm_unit_offset": True},
        {"num_experts": 4, "experts_per_token": 2, "expert_mlp_dim": 16, "dense_layers": [1]},
        {**LATENT, "q_lora_rank": 8, "value_head_dim": 6, "rope_interleaved": True},
        {**LATENT, "value_head_dim": 12, "scan_layers": True},
    ],
    ids=["loop", "scan", "mqa-local-rope", "softcaps", "experts", "latent", "latent-scan"],
)
def test_decoding_against_the_cache_equals_the_full_forward_pass(batch, variant):
    """Mixed sliding and full layers, decoding 22 tokens past a prompt of 10: the sliding
    layers' window (8) passes over the cache's earlier positions."""
    model = build(**{**MIXED, **variant})
    tokens = inputs(batch)[:2]
    model.eval()
    np.testing.assert_allclose(
        decoded(model, tokens, 10), logits(model, tokens), rtol=1e-5, atol=2e-5
    )


@pytest.mark.parametrize("scan_layers", [False, True], ids=["loop", "scan"])
def test_latent_attention_caches_the_latent_and_the_rotated_key(scan_layers):
    """Per token and layer, the cache holds kv_lora_rank + rope_head_dim numbers (8 + 4), not
    every head's keys and values (4 heads x (8 + 8)); a sliding layer's its window only."""
    model = build(**MIXED, **LATENT, scan_layers=scan_layers)
    with activate():
        cache = model.empty_cache(2, 24)
    layers = [cache] if scan_layers else list(cache)
    shapes = [(keys.shape[-4:], values.shape[-4:]) for keys, values in layers]
    if scan_layers:
        assert shapes == [((2, 24, 1, 8), (2, 24, 1, 4))]
    else:
        windows = [8, 24, 8]  # sliding, full, sliding
        assert shapes == [((2, n, 1, 8), (2, n, 1, 4)) for n in windows]


def test_scanned_layers_compute_what_the_layer_loop_does(batch):
    """Dropout on, mixed layer types, remat: the same weights, loss and gradients."""
    loop = build(**MIXED, dropout_rate=0.1)
    scanned = build(**MIXED, dropout_rate=0.1, scan_layers=True, remat=True)
    for i in range(3):  # layer i of the loop is slice i of the stack
        for a, b in zip(
            jax.tree.leaves(nnx.state(loop.layers[i], nnx.Param)),
            jax.tree.leaves(nnx.state(scanned.layers, nnx.Param)),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[i])
    loss_fn = zoo.get_model("decoder").loss

    @nnx.jit
    def loss_and_grads(model, batch, rngs):
        def mean_loss(model, rngs):
            return jnp.mean(loss_fn(model, batch, rngs)[0])

        return nnx.value_and_grad(mean_loss)(model, rngs)

    with activate():
        loop_loss, loop_grads = loss_and_grads(loop, batch, nnx.Rngs(0))
        scan_loss, scan_grads = loss_and_grads(scanned, batch, nnx.Rngs(0))
        loop.eval()
        eval_loss, _ = loss_and_grads(loop, batch, nnx.Rngs(0))
    assert abs(float(eval_loss) - float(loop_loss)) > 1e-4  # dropout did act
    np.testing.assert_allclose(scan_loss, loop_loss, rtol=1e-5)
    for i in range(3):
        for a, b in zip(
            jax.tree.leaves(loop_grads["layers"][i]),
            jax.tree.leaves(scan_grads["layers"]),
            strict=True,
        ):
            np.testing.assert_allclose(np.asarray(b)[i], np.asarray(a), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(
        scan_grads["embedding"][...], loop_grads["embedding"][...], rtol=1e-4, atol=1e-6
    )


# ---- meshes -----------------------------------------------------------------------------------

GEMMA_LIKE = {
    "tie_embeddings": False,
    "qkv_bias": True,
    "out_bias": True,
    "mlp_bias": True,
    "post_norms": True,
    "norm_unit_offset": True,
    "activation": "gelu_tanh",
    "embed_scale": True,
    "query_scale": 12.0,
    "attention_softcap": 20.0,
    "final_softcap": 10.0,
    "local_rope_theta": 100.0,
}


EXPERTS = {"num_experts": 4, "experts_per_token": 2, "expert_mlp_dim": 16, "dense_layers": [0]}
"""A dense first layer, then a mixture of 4 experts, 2 per token."""


DEEPSEEK_LIKE = {
    **EXPERTS,
    **LATENT,
    "q_lora_rank": 8,
    "router_softmax": "sigmoid",
    "router_groups": 2,
    "router_groups_kept": 1,
    "expert_weight_scale": 2.5,
    "shared_expert_mlp_dim": 16,
}
"""Latent attention, and experts routed by sigmoid scores within groups beside a shared one."""


@pytest.mark.parametrize(
    ("variant", "kv_rule"),
    [
        ({}, "tensor"),
        ({}, None),
        (GEMMA_LIKE, "tensor"),
        (EXPERTS, "tensor"),
        (DEEPSEEK_LIKE, "tensor"),
    ],
    ids=["kv-split", "kv-unsplit", "every-option", "experts", "deepseek"],
)
def test_the_loss_on_the_2x2x2_mesh_is_the_loss_on_one_device(batch, variant, kv_rule):
    """Heads, key/value heads (or not: the query heads split, the key/value heads whole), the
    MLP and the vocabulary over `tensor`; decoding on the mesh too."""
    rules = {**RULES, "kv_heads": kv_rule}
    split = build(MESH, rules, **variant)
    one = on_one_device(split)
    loss_fn = zoo.get_model("decoder").loss

    def loss(model, batch):
        return loss_fn(model, batch, nnx.Rngs(0))[0]

    with activate(MESH, rules):
        on_mesh = np.asarray(nnx.jit(loss)(split, batch))
    with activate(ONE_DEVICE, rules):
        on_one = np.asarray(nnx.jit(loss)(one, batch))
    np.testing.assert_allclose(on_mesh, on_one, rtol=1e-5)
    tokens = inputs(batch)
    np.testing.assert_allclose(
        decoded(split, tokens, 10, MESH, rules), logits(one, tokens), rtol=1e-5, atol=2e-5
    )


# ---- mixtures of experts ---------------------------------------------------------------------


@pytest.mark.parametrize("normalize", [False, True], ids=["softmax", "normalized"])
def test_experts_compute_what_a_loop_over_tokens_and_their_experts_does(batch, normalize):
    """Each token's output is the sum of its chosen experts' gated MLPs, weighted by the
    router's probabilities (divided by their sum when normalized), written out in numpy."""
    model = build(
        num_experts=4,
        experts_per_token=2,
        expert_mlp_dim=16,
        normalize_expert_weights=normalize,
    )
    layer = model.layers[0].mlp
    x = np.random.default_rng(0).normal(size=(2, 5, 32)).astype(np.float32)
    with activate(), jax.default_matmul_precision("highest"):
        out = np.asarray(nnx.jit(lambda m, x: m(x))(layer, x))
    p = {k: np.asarray(v[...], np.float64) for k, v in _flat(layer).items()}
    tokens = x.reshape(-1, 32).astype(np.float64)
    logits = tokens @ p["router.kernel"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    expected = np.zeros_like(tokens)
    for t, token in enumerate(tokens):
        chosen = np.argsort(-probs[t])[:2]
        weights = probs[t, chosen] / (probs[t, chosen].sum() if normalize else 1.0)
        for e, w in zip(chosen, weights, strict=True):
            gate, up = p["experts.gate"][e] @ token, p["experts.up"][e] @ token
            hidden = gate / (1 + np.exp(-gate)) * up
            expected[t] += w * (p["experts.down"][e] @ hidden)
    np.testing.assert_allclose(out.reshape(-1, 32), expected, rtol=1e-5, atol=1e-6)


def test_the_expert_load_counts_each_real_token_of_rows_and_of_pairs(batch):
    """The eval picture's counts (`expert_load`): every real token of every real row, a pair's
    two sequences each, experts_per_token times; padding and padding rows nowhere."""
    model = build(**EXPERTS)
    tokens = batch[TOKENS][:4].astype(np.int32)
    rows = {"tokens": tokens, "length": np.array([31, 20, 9, 31], np.int32)}
    rows[MASK] = np.array([1, 1, 1, 0], np.int32)
    pairs = {  # rows 0 and 1 as one pair, row 2 with row 3 (a padding pair)
        "tokens": tokens.reshape(2, 2, -1),
        "length": rows["length"].reshape(2, 2),
        MASK: np.array([1, 0], np.int32),
    }
    with activate():
        counts = {
            name: np.asarray(expert_load(model, b))
            for name, b in (("rows", rows), ("pairs", pairs))
        }
    assert counts["rows"].shape == (1, 4)  # one mixture layer, four experts
    assert counts["rows"].sum() == 2 * (32 + 21 + 10)  # 2 experts for each real input token
    assert counts["pairs"].sum() == 2 * (32 + 21)
    with activate():
        (first,) = np.asarray(expert_load(model, {**rows, MASK: np.array([1, 0, 0, 0], np.int32)}))
    assert first.sum() == 2 * 32 and np.all(first <= counts["rows"][0])
    segments = np.repeat([[1, 2, 0]], [20, 10, 2], axis=1).repeat(4, 0).astype(np.int32)
    positions = np.concatenate([np.arange(20), np.arange(10), [0, 0]])[None].repeat(4, 0)
    packed = {**rows, SEGMENT_IDS: segments, POSITIONS: positions.astype(np.int32)}
    with activate():
        assert np.asarray(expert_load(model, packed)).sum() == 2 * 30 * 3  # three real rows


# ---- bfloat16 ---------------------------------------------------------------------------------


def test_bf16_params_are_held_and_computed_in_bfloat16(batch):
    model = build(**GEMMA_LIKE, param_dtype="bf16")
    dtypes = {path: v[...].dtype for path, v in _flat(model).items()}
    assert set(dtypes.values()) == {jnp.dtype(jnp.bfloat16)}, dtypes
    out = logits(model, inputs(batch))
    assert out.dtype == jnp.bfloat16
    with activate():
        assert model.empty_cache(1, 16)[0][0].dtype == jnp.bfloat16
        loss = nnx.jit(lambda m, b: zoo.get_model("decoder").loss(m, b, nnx.Rngs(0))[0])(
            model, batch
        )
    assert loss.dtype == jnp.float32 and np.all(np.isfinite(loss))
    assert abs(float(jnp.mean(loss)) - math.log(256)) < 0.5  # near chance, as at the start


# ---- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"num_kv_heads": 3}, "model.num_kv_heads=3 must divide model.num_heads=4"),
        ({"num_kv_heads": -1}, "model.num_kv_heads=-1"),
        ({"dim": 30, "head_dim": 0}, "model.dim=30 must be a multiple of model.num_heads=4"),
        ({"head_dim": 7}, "must be even"),
        ({"activation": "relu"}, "model.activation='relu'"),
        ({"rope_type": "dynamic"}, "model.rope_type='dynamic'"),
        ({"rope_type": "yarn", "rope_beta_slow": 0.0}, "model.rope_beta_slow=0.0"),
        ({"rope_attention_factor": -1.0}, "model.rope_attention_factor=-1.0"),
        ({"activation": "clamped_swiglu", "swiglu_limit": 0.0}, "model.swiglu_limit=0.0"),
        ({"router_bias": True}, "model.router_bias=True sets a mixture of experts' router"),
        ({"num_experts": 4, "router_softmax": "top"}, "model.router_softmax='top'"),
        (
            {"num_experts": 4, "router_softmax": "chosen", "normalize_expert_weights": False},
            "model.normalize_expert_weights=false keeps",
        ),
        ({"param_dtype": "fp16"}, "model.param_dtype='fp16'"),
        ({"layer_types": [SLIDING]}, "model.depth=2"),
        ({"layer_types": [SLIDING, "local"]}, "model.layer_types[1]='local'"),
        ({"sliding_window": 0}, "model.sliding_window=0"),
        ({"rope_factor": 0.0}, "model.rope_factor=0.0"),
        ({"rope_type": "llama3", "rope_high_freq_factor": 1.0}, "model.rope_high_freq_factor"),
        ({"final_softcap": -1.0}, "model.final_softcap=-1.0"),
        ({"norm_epsilon": 0.0}, "model.norm_epsilon=0.0"),
        ({"dropout_rate": 1.0}, "model.dropout_rate=1.0"),
        ({"depth": 0, "layer_types": None}, "model.depth=0"),
        ({"num_experts": -1}, "model.num_experts=-1"),
        ({"num_experts": 4, "experts_per_token": 5}, "model.experts_per_token=5"),
        ({"num_experts": 4, "dense_layers": [2]}, "model.dense_layers=[2] names layers [2]"),
        ({"router_aux_loss_coef": 0.01}, "model.router_aux_loss_coef=0.01 weighs"),
        ({"num_experts": 4, "router_aux_loss_coef": -1.0}, "model.router_aux_loss_coef=-1.0"),
        (
            {"num_experts": 4, "dense_layers": [0], "scan_layers": True},
            "model.scan_layers=true runs one layer's structure",
        ),
        ({"q_lora_rank": 8}, "model.q_lora_rank=8 sets multi-head latent attention"),
        ({"kv_lora_rank": 8}, "model.rope_head_dim=0 must be between 1 and"),
        ({**LATENT, "num_kv_heads": 2}, "model.num_kv_heads=2 groups the key/value heads"),
        ({**LATENT, "rope_mscale_all_dim": 1.0}, "model.rope_mscale_all_dim=1.0 is YaRN's"),
        ({"num_experts": 4, "router_groups": 2}, "or model.router_softmax='sigmoid'"),
        (
            {"num_experts": 4, "router_softmax": "sigmoid", "router_groups": 4},
            "model.router_groups=4 must split model.num_experts=4",
        ),
        ({"expert_weight_scale": 2.0}, "model.expert_weight_scale=2.0 sets a mixture"),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else "",
)
def test_bad_hyper_parameters_are_refused_by_name(overrides, named):
    with pytest.raises(ZooError, match=named.replace("[", r"\[").replace("(", r"\(")):
        build(**overrides)


def test_sequences_longer_than_the_context_are_refused(batch):
    model = build()
    tokens = np.zeros((2, 33), np.int32)
    with pytest.raises(ZooError, match="33 tokens, more than model.context_length=32"):
        logits(model, tokens)

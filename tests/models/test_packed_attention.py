"""Packed rows (`data.packing`, `zoo.data.packing`) in `decoder`, on the decoder fixtures: a row
of several conversations gives each the loss, the gradients and the logits it has alone (its
attention stays within it, its rotary positions restart at 0), on zoo's CPU attention kernel and
on jax's `dot_product_attention`, full and sliding-window layers, stacked (scanned) layers too;
and the CPU kernel's segments against jax's kernel with the same mask."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance.checks import ONE_DEVICE, on_mesh
from flax import nnx
from pretrained_checks import FIXTURES, loaded
from zoo.data.packing import pack
from zoo.engine.kernels import attention, attention_cpu
from zoo.engine.kernels.attention import Platform
from zoo.engine.registry import WEIGHT
from zoo.models.language_model import language_model_loss

FAMILIES = ["qwen3-tiny", "mistral-window", "gemma3-tiny"]
"""Full attention (Qwen 3, its heads normed), a window of 5 on every layer (Mistral), and both
kinds of layers with their own rotary bases (Gemma 3, a window of 4). Packing is the same code
for every family; what they differ in (biases, rotary scalings) is per token."""
LENGTHS = (9, 6, 13)
"""Three conversations, each longer than every fixture's window."""
ROW = 32


@pytest.fixture(scope="module")
def models():
    """Each fixture's model (and one with stacked layers), loaded once, as it is needed."""
    cache = {}

    def model(name: str, **overrides):
        key = (name, *sorted(overrides.items()))
        if key not in cache:
            cache[key] = loaded(FIXTURES / name, **overrides)[0]
        return cache[key]

    return model


def conversations(seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, loss marks) of each conversation: ids under every fixture's 300, marks on most."""
    rng = np.random.default_rng(seed)
    return [
        (rng.integers(1, 300, n).astype(np.int32), (rng.random(n) < 0.7).astype(np.uint8))
        for n in LENGTHS
    ]


def padded(pieces: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """The conversations one to a row, as `data=chat` batches them unpacked."""
    longest = max(len(ids) for ids, _ in pieces)
    tokens = np.zeros((len(pieces), longest), np.int32)
    marks = np.zeros((len(pieces), longest), np.uint8)
    for i, (ids, trained) in enumerate(pieces):
        tokens[i, : len(ids)], marks[i, : len(ids)] = ids, trained
    length = np.asarray([len(ids) - 1 for ids, _ in pieces], np.int32)
    return {"tokens": tokens, "length": length, "loss_mask": marks[:, 1:]}


def mean_loss_and_grads(model, batch):
    """The token-weighted mean loss over the batch (what the trainer minimises) and its
    gradients with respect to every param."""

    def mean(model, batch):
        loss, metrics = language_model_loss(model, batch, nnx.Rngs(0))
        return jnp.sum(loss * metrics[WEIGHT]) / jnp.sum(metrics[WEIGHT])

    with on_mesh(ONE_DEVICE), jax.default_matmul_precision("highest"):
        loss, grads = nnx.jit(nnx.value_and_grad(mean))(model, batch)
    return float(loss), {path: np.asarray(g) for path, g in nnx.to_flat_state(grads)}


@pytest.mark.parametrize("name", FAMILIES)
def test_packed_and_unpacked_batches_give_the_same_loss_and_gradients(models, name):
    pieces = conversations()
    packed = pack([pieces], ROW)
    assert packed["length"].tolist() == [sum(LENGTHS) - 1]
    loss, grads = mean_loss_and_grads(models(name), packed)
    alone_loss, alone_grads = mean_loss_and_grads(models(name), padded(pieces))
    assert abs(loss - alone_loss) <= 1e-6
    assert grads.keys() == alone_grads.keys()
    for path, grad in grads.items():
        np.testing.assert_allclose(grad, alone_grads[path], rtol=0, atol=1e-6, err_msg=str(path))


def packed_logits(model, batch) -> np.ndarray:
    def forward(model, tokens, segment_ids, positions):
        return model(tokens, segment_ids=segment_ids, positions=positions)

    inputs = (batch["tokens"][:, :-1], batch["segment_ids"], batch["positions"])
    with on_mesh(ONE_DEVICE), jax.default_matmul_precision("highest"):
        return np.asarray(nnx.jit(forward)(model, *inputs))


PATHS = {
    # On a CPU, full-attention layers take zoo's kernel; sliding ones jax's.
    "cpu-kernel": None,
    # As on a GPU without cuDNN: every layer takes jax's `dot_product_attention` (XLA's).
    "jax": Platform("gpu"),
}


@pytest.mark.parametrize(
    ("name", "overrides", "path"),
    [
        ("qwen3-tiny", {}, "cpu-kernel"),
        ("qwen3-tiny", {}, "jax"),
        ("mistral-window", {}, "jax"),
        ("gemma3-tiny", {}, "cpu-kernel"),
        ("gemma3-tiny", {}, "jax"),
        ("gemma3-tiny", {"scan_layers": True}, "cpu-kernel"),
        # Soft-capped logits: attention written out (the path Dropout takes too).
        ("gemma3-tiny", {"attention_softcap": 20.0}, "jax"),
    ],
    ids=lambda value: ("-".join(value) or "as-stored") if isinstance(value, dict) else None,
)
def test_a_perturbed_conversation_leaves_the_others_logits_unchanged(
    models, name, overrides, path, monkeypatch
):
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs["segments"] is not None)
        return attend(*args, **kwargs)

    attend = attention_cpu.attend
    monkeypatch.setattr(attention_cpu, "attend", counted)
    if PATHS[path] is not None:
        monkeypatch.setattr(attention, "current_platform", lambda: PATHS[path])
    model = models(name, **overrides)
    pieces = conversations()
    changed = [pieces[0], (np.roll(pieces[1][0], 1) + 7, pieces[1][1]), pieces[2]]
    before = packed_logits(model, pack([pieces], ROW))
    after = packed_logits(model, pack([changed], ROW))
    second = slice(LENGTHS[0], LENGTHS[0] + LENGTHS[1])
    assert np.abs(before[:, second] - after[:, second]).max() > 1e-2  # the change is seen
    for kept in (slice(0, LENGTHS[0]), slice(second.stop, sum(LENGTHS))):
        np.testing.assert_allclose(after[:, kept], before[:, kept], rtol=0, atol=1e-6)
    assert all(calls) and bool(calls) == (path == "cpu-kernel")


def test_positions_restart_at_each_conversation(models):
    """Each conversation's logits in the row are those it has alone, from position 0: the last
    one's, at row positions 15 to 27, among them."""
    name = "qwen3-tiny"
    pieces = conversations()
    row = packed_logits(models(name), pack([pieces], ROW))
    at = 0
    for ids, _ in pieces:

        def forward(model, tokens):
            return model(tokens)

        with on_mesh(ONE_DEVICE), jax.default_matmul_precision("highest"):
            alone = np.asarray(nnx.jit(forward)(models(name), ids[None]))
        np.testing.assert_allclose(row[:, at : at + len(ids)], alone, rtol=0, atol=1e-5)
        at += len(ids)


@pytest.mark.parametrize("length", [40, 200])  # one block of queries, and three
def test_the_cpu_kernels_segments_are_jaxs_mask(length):
    keys = jax.random.split(jax.random.key(length), 3)
    q, k, v = (jax.random.normal(key, (2, length, 2, 8)) for key in keys)
    ends = np.sort(np.random.default_rng(length).integers(1, length, (2, 4)), axis=1)
    segments = jnp.asarray(1 + (np.arange(length)[None, :, None] >= ends[:, None, :]).sum(-1))
    same = (segments[:, :, None] == segments[:, None, :])[:, None]

    def ours(q, k, v):
        return attention_cpu.attend(q, k, v, scale=None, causal=True, segments=segments)

    def theirs(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, mask=same, is_causal=True)

    for attend in (ours, theirs):
        grads = jax.jit(jax.grad(lambda *a, f=attend: jnp.sum(f(*a) ** 2), (0, 1, 2)))(q, k, v)
        got = [jax.jit(attend)(q, k, v), *grads]
        if attend is ours:
            expected = got
        else:
            for a, b in zip(expected, got, strict=True):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)

"""The generation engine (`zoo.models.sampling_loop`) on every decoder family's fixture: a ragged
batch of prompts (3 to 40 tokens) decoded greedily writes what each prompt writes alone and what
transformers writes (`tests/fixtures/pretrained/generation.json`, by `make_generation.py`), on
one device and on the 2x2x2 mesh; a session compiles one prefill per prompt bucket and one
decode step; sliding-window layers keep only their window; top-k, top-p and min-p sample from the
renormalised distribution; end-of-sequence ids and stop strings end each row on its own;
streamed text is the whole text in pieces."""

from __future__ import annotations

import collections
import functools
import json
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance.checks import MESH, ONE_DEVICE, on_mesh
from pretrained_checks import FIXTURES, loaded
from zoo.data.text import load_tokenizer
from zoo.models import sampling_loop
from zoo.models.kv_cache import Slots
from zoo.models.sampling_loop import COMPILATIONS, Sampling, Session
from zoo.models.text_completion import Codec, Request, complete, stream

FAMILIES = ("llama-tiny", "qwen2-tiny", "qwen3-tiny", "mistral-window", "gemma3-tiny", "gpt2-tiny")
REFERENCE = json.loads((FIXTURES / "generation.json").read_text())
GREEDY = Sampling(temperature=0)
SLOTS = 128  # the longest prompt's bucket (64) and the new tokens
ROWS = 8  # more rows than prompts: the rest are filler


def prompts_of(name: str) -> tuple[list[np.ndarray], list[list[int]]]:
    reference = REFERENCE[name]
    return [np.asarray(p, np.int32) for p in reference["prompts"]], reference["greedy"]


@functools.cache
def one_device(name: str):
    """The fixture's model on one device, loaded once for the tests that use it."""
    return loaded(FIXTURES / name)[0]


def compiled_since(before: collections.Counter) -> collections.Counter:
    """What compiled since `before`: per function name."""
    return collections.Counter(key[0] for key in (COMPILATIONS - before).elements())


@pytest.mark.parametrize("name", FAMILIES)
def test_a_ragged_batch_equals_each_prompt_alone_and_transformers(name, caplog):
    model = one_device(name)
    caplog.set_level(logging.DEBUG, "zoo.generation")
    prompts, expected = prompts_of(name)
    new = len(expected[0])
    jax.clear_caches()  # so that what compiles here is counted, whatever ran before
    with on_mesh(ONE_DEVICE), jax.default_matmul_precision("highest"):
        order = [3, 0, 4, 2, 1]  # not sorted by length
        batch = Session(model, ROWS, SLOTS).generate([prompts[i] for i in order], new, GREEDY)
        alone_session = Session(model, 1, SLOTS)
        before = COMPILATIONS.copy()
        alone = [alone_session.generate([p], new, GREEDY)[0].tokens for p in prompts]
        compiled = compiled_since(before)
        again = [alone_session.generate([p], new, GREEDY)[0].tokens for p in prompts[::-1]]
    assert [len(p) for p in prompts] == [3, 8, 17, 26, 40]
    assert [batch[order.index(i)].tokens for i in range(len(prompts))] == expected
    assert alone == expected
    assert again == expected[::-1]
    # Buckets 16 (3 and 8 tokens), 32 (17, 26) and 64 (40): a prefill each, one decode step;
    # the same prompts again compile nothing.
    assert compiled == {"prefill": 3, "decode": 1}
    assert compiled_since(before) == compiled
    said = [r.getMessage().split(" of ")[0] for r in caplog.records if r.name == "zoo.generation"]
    assert collections.Counter(said) == {"compiling the prefill": 4, "compiling the decode step": 2}


@pytest.mark.parametrize("rows", ["whole", "split"])
@pytest.mark.parametrize("name", FAMILIES)
def test_a_ragged_batch_on_the_mesh_equals_transformers(name, rows):
    """Heads split over `tensor` (key/value heads too where they divide); the batch whole, or
    its rows split over the batch axes (`data`, `fsdp`: a session of reward fine-tuning's
    completions)."""
    model, _ = loaded(FIXTURES / name, MESH)
    prompts, expected = prompts_of(name)
    with on_mesh(MESH), jax.default_matmul_precision("highest"):
        session = Session(model, ROWS, SLOTS, split=rows == "split")
        batch = session.generate(prompts, len(expected[0]), GREEDY)
    assert [row.tokens for row in batch] == expected
    kv_heads = getattr(model, "num_kv_heads", getattr(model, "num_heads", 0))
    heads = "tensor" if kv_heads % MESH["tensor"] == 0 else None  # one key/value head: whole
    for keys, values in session._cache:
        assert keys.sharding.spec[2] == values.sharding.spec[2] == heads
        assert keys.sharding.spec[0] == (("data", "fsdp", "expert") if rows == "split" else None)


@pytest.mark.parametrize(("name", "windows"), [("mistral-window", 5), ("gemma3-tiny", 4)])
def test_sliding_layers_keep_only_their_window(name, windows):
    """The prompts above run past the window (40 tokens + 12 against 5): the sliding layers'
    caches stay the window's length whatever the session's, the full layers' grow with it."""
    model = one_device(name)
    with on_mesh(ONE_DEVICE):
        short, long = (Session(model, 2, slots)._cache for slots in (64, 1024))
    sliding = [t == "sliding_attention" for t in model.layer_types]
    for kind, s, l in zip(sliding, short, long, strict=True):
        lengths = {c.shape[1] for c in s}, {c.shape[1] for c in l}
        assert lengths == (({windows}, {windows}) if kind else ({64}, {1024}))


def chi_square_critical(df: int) -> float:
    """The chi-square value that a statistic of `df` degrees of freedom exceeds with
    probability 0.001 (Wilson-Hilferty)."""
    z = 3.0902
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


LOGITS = np.asarray([2.0, 1.6, 1.5, 1.1, 0.7, 0.4, 0.3, 0.0, -0.5, -1.0, -2.0, -3.0], np.float32)


def renormalised(sampling: Sampling) -> np.ndarray:
    """The distribution `Sampling` describes on `LOGITS`, written out."""
    probs = np.exp(LOGITS / sampling.temperature)
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    kept = np.zeros(len(probs), bool)
    k = sampling.top_k or len(probs)
    kept[order[:k]] = True
    mass = 0.0
    for i in order[:k]:  # the fewest likeliest holding top_p
        kept[i] = mass < sampling.top_p
        mass += probs[i] / probs[order[:k]].sum()
    within = np.where(kept, probs, 0) / np.where(kept, probs, 0).sum()
    kept &= within >= sampling.min_p * within.max()
    out = np.where(kept, probs, 0)
    return out / out.sum()


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(1.0, top_k=4),
        Sampling(1.0, top_p=0.8),
        Sampling(1.0, min_p=0.2),
        Sampling(0.7, top_k=6, top_p=0.9, min_p=0.1),
        Sampling(1.5),
    ],
    ids=["top_k", "top_p", "min_p", "all", "temperature"],
)
def test_sampling_draws_from_the_renormalised_distribution(sampling):
    draws = 40_000
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (draws, len(LOGITS)))
    keys = jax.random.split(jax.random.key(7), draws)
    choose = jax.jit(sampling_loop.choose, static_argnames="filters")
    with on_mesh(ONE_DEVICE):
        tokens, logprobs = choose(logits, keys, sampling.values(), sampling.filters)
    counts = np.bincount(np.asarray(tokens), minlength=len(LOGITS))
    expected = renormalised(sampling)
    assert counts[expected == 0].sum() == 0  # nothing outside the kept tokens
    kept = expected > 0
    assert 2 <= kept.sum() < len(LOGITS) or sampling.filters == ()
    statistic = np.sum((counts[kept] - draws * expected[kept]) ** 2 / (draws * expected[kept]))
    assert statistic < chi_square_critical(int(kept.sum()) - 1), (counts, expected * draws)
    full = jax.nn.log_softmax(jnp.asarray(LOGITS))  # log-probabilities of the model's own
    np.testing.assert_allclose(np.asarray(logprobs), np.asarray(full)[np.asarray(tokens)], 1e-6)


def test_seeds_per_call_and_per_row():
    """A seed gives the same rows again, and a row the same text in any batch it is the first
    row of; another seed, other text."""
    name = "qwen3-tiny"
    model = one_device(name)
    prompts, _ = prompts_of(name)
    warm = Sampling(1.2, top_k=50)
    with on_mesh(ONE_DEVICE):
        session = Session(model, ROWS, SLOTS)
        first = [r.tokens for r in session.generate(prompts, 12, warm, seed=3)]
        same = [r.tokens for r in session.generate(prompts, 12, warm, seed=3)]
        other = [r.tokens for r in session.generate(prompts, 12, warm, seed=4)]
        alone = Session(model, 1, SLOTS).generate(prompts[:1], 12, warm, seed=3)[0].tokens
    assert first == same != other
    assert alone == first[0]


def test_eos_ends_each_row_on_its_own():
    name = "llama-tiny"
    model = one_device(name)
    prompts, expected = prompts_of(name)
    eos = expected[2][4]  # a token row 2 writes fifth
    with on_mesh(ONE_DEVICE):
        done = Session(model, ROWS, SLOTS).generate(prompts, 12, GREEDY, eos=[eos, 299])
    for row, want in zip(done, expected, strict=True):
        cut = want.index(eos) if eos in want else len(want)
        assert row.tokens == want[:cut]
        assert row.finish == ("eos" if eos in want else "length")
    assert sum(row.finish == "eos" for row in done) >= 1
    assert sum(row.finish == "length" for row in done) >= 1


def test_stop_strings_end_each_row_on_its_own_and_stream_in_pieces():
    name = "llama-tiny"
    model = one_device(name)
    tokenizer = load_tokenizer(FIXTURES / name)
    codec = Codec(tokenizer)
    prompts, expected = prompts_of(name)
    texts = [codec.decode(p) for p in prompts]
    assert [codec.encode(t).tolist() for t in texts] == [p.tolist() for p in prompts]
    written = [codec.decode(w) for w in expected]
    stop = written[1][3:6]  # cut from the middle of what row 1 writes
    request = Request(12, GREEDY, stop=(stop, "never written"))
    with on_mesh(ONE_DEVICE):
        done = complete(model, texts, request, codec)
        pieces = list(stream(model, texts[1], request, codec))
        whole = list(stream(model, texts[4], Request(12, GREEDY), codec))
    for row, text in zip(done, written, strict=True):
        assert row.text == text.split(stop)[0]
        assert row.finish == ("stop" if stop in text else "length")
        assert len(row.tokens) < 12 if stop in text else len(row.tokens) == 12
    assert "".join(pieces) == done[1].text
    assert len(whole) > 1 and "".join(whole) == written[4]


@pytest.mark.parametrize("name", ["qwen3-tiny", "gpt2-tiny"])
def test_a_prefill_computes_the_logits_of_each_row_s_last_token_alone(name):
    """What the engine's prefill asks for (`last_only`): the output layer for one position of
    each row, not the whole prompt, with the logits and the cache of the whole."""
    model = one_device(name)
    tokens = jnp.asarray(np.arange(24, dtype=np.int32).reshape(2, 12) % 50 + 1)
    slots = Slots(jnp.int32(0), jnp.asarray([0, 4], jnp.int32), prefill=True)
    with on_mesh(ONE_DEVICE), jax.default_matmul_precision("highest"):
        whole, whole_cache = model.decode(tokens, model.empty_cache(2, 16), slots)
        last, last_cache = model.decode(tokens, model.empty_cache(2, 16), slots, last_only=True)
    assert last.shape == (2, 1, whole.shape[2])
    np.testing.assert_allclose(np.asarray(last[:, 0]), np.asarray(whole[:, -1]), atol=1e-5)
    for a, b in zip(jax.tree.leaves(whole_cache), jax.tree.leaves(last_cache), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

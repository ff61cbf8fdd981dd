"""zoo.engine.kernels.bf16_rows: the bfloat16 product of a few rows by a kernel held outputs first, on the
CPU's bfloat16 dot products where the CPU has them (AVX-512 BF16), XLA's product elsewhere. On
either path it is the float32 sum of the exact products of the bfloat16 operands to within
float32 rounding, rounded to bfloat16 as XLA rounds, for every row count and remainder of the
kernel's tiles and a contraction that is not a multiple of its 32-wide vectors, and a bfloat16
decoder decodes through it: a ragged batch decoded greedily writes what each prompt writes
alone, and a decoding step's logits are the float32 model's to bfloat16's precision. The
kernel's own: a row has the same bits in any batch, its gradient is XLA's product's, and on a
mesh of several devices, or switched off, XLA's product is taken. Every test that takes a `path`
runs twice: on the kernel (skipped, with the reason, on a CPU without AVX-512 BF16) and on the
fallback a CPU without it takes, forced here by hiding the instructions from the CPU check, so
a machine that has them checks both."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance.checks import MESH, ONE_DEVICE, on_mesh
from flax import nnx
from pretrained_checks import FIXTURES, loaded
from zoo.engine.errors import ZooError
from zoo.engine.kernels import bf16_rows
from zoo.engine.kernels.dense import FEW_ROWS, outputs_first_product
from zoo.models.generation import Sampling, Session
from zoo.models.kv_cache import Slots

BF16 = jnp.bfloat16
KERNEL, FALLBACK = "kernel", "fallback"


def why_the_kernel_cannot_run() -> str | None:
    """Why this machine cannot run the kernel (a reason to skip its tests with), or None."""
    if not bf16_rows._cpu_has_bf16_dot():
        return (
            "this CPU lacks AVX-512 BF16 (no avx512_bf16 flag: the vdpbf16ps instruction the "
            "kernel multiplies with); its fallback, XLA's product, is tested"
        )
    if bf16_rows._compiler() is None:
        return "no C++ compiler (c++, g++ or $CXX) to compile the kernel with"
    return None


@pytest.fixture(scope="module", params=[KERNEL, FALLBACK])
def path(request):
    """KERNEL: the kernel, compiled and registered. FALLBACK: what a CPU without AVX-512 BF16
    runs: the CPU check says no, `available` is asked anew (its cached answer set aside), and
    jax's caches are cleared on the way in and out so that no program traced on the other path
    is reused."""
    if request.param == KERNEL:
        if reason := why_the_kernel_cannot_run():
            pytest.skip(reason)
        assert bf16_rows.available()
        yield KERNEL
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bf16_rows, "_cpu_has_bf16_dot", lambda: False)
        patch.setattr(bf16_rows, "available", functools.cache(bf16_rows.available.__wrapped__))
        jax.clear_caches()
        yield FALLBACK
    jax.clear_caches()


kernel_only = pytest.mark.parametrize("path", [KERNEL], indirect=True)


def operands(rows: int, outputs: tuple[int, ...], inputs: tuple[int, ...], seed: int = 0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (rows, *inputs)).astype(BF16)
    w = jax.random.normal(kw, (*outputs, *inputs)).astype(BF16)
    return x, w


def float64_product(x, w, inputs: int):
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    axes = (list(range(x64.ndim - inputs, x64.ndim)), list(range(w64.ndim - inputs, w64.ndim)))
    return np.tensordot(x64, w64, axes), np.tensordot(np.abs(x64), np.abs(w64), axes)


def program(x, w) -> str:
    """The lowered program of a dense layer's product held outputs first (traced anew)."""
    return jax.jit(lambda x, w: outputs_first_product(x, w)).lower(x, w).as_text()


def test_the_kernel_is_taken_where_it_runs_and_xla_s_product_elsewhere(path):
    """Where it runs, a silent fallback would leave the kernel untested; a CPU without AVX-512
    BF16 takes XLA's product, and more rows than a decoding step's take it on every CPU."""
    x, w = operands(8, (64,), (32,))
    assert bf16_rows.available() == bf16_rows.applies(x, w) == (path == KERNEL)
    assert not bf16_rows.applies(x.astype(jnp.float32), w.astype(jnp.float32))
    text = program(x, w)
    assert (bf16_rows.TARGET in text) == (path == KERNEL)
    assert ("dot_general" in text) == (path == FALLBACK)
    many = operands(FEW_ROWS + 1, (64,), (32,))[0]  # more rows than a decoding step's: XLA's
    assert bf16_rows.TARGET not in program(many, w)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 15])
@pytest.mark.parametrize(
    ("outputs", "inputs"), [((131,), (100,)), ((4, 8), (64,)), ((24,), (2, 48))]
)
def test_the_product_is_the_float32_sum_of_the_exact_products(path, rows, outputs, inputs):
    """Every row tile (8, 4, 2, 1 rows) and output remainder; 100 and 96 inputs are not whole
    32-wide vectors; several output (heads x head size) or input axes. Float32 rounding of a
    sum of k terms: under k x 2^-24 of the sum of their magnitudes; then bfloat16's rounding."""
    x, w = operands(rows, outputs, inputs)
    got = np.asarray(outputs_first_product(x, w, len(inputs)), np.float64)
    want, scale = float64_product(x, w, len(inputs))
    assert got.shape == want.shape == (rows, *outputs)
    terms = np.prod(inputs)
    bound = 2.0**-8 * np.abs(want) + terms * 2.0**-24 * scale
    assert (np.abs(got - want) <= bound).all()


@pytest.mark.parametrize(
    "exact", [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1.5 * 2**127 + 2**119, 1 + 2**-7 + 2**-12]
)
def test_the_float32_sum_is_rounded_to_bfloat16_as_xla_rounds_it(path, exact):
    """Sums exact in float32: halfway between two bfloat16 numbers (to even: down, then up),
    negative, halfway near the largest, above halfway."""
    a = np.float32(exact)
    high = jnp.asarray(a, BF16)
    low = jnp.asarray(np.float32(a - np.float32(high)), BF16)  # a = high + low, exactly
    assert np.float32(high) + np.float32(low) == a
    x = jnp.ones((1, 2), BF16)
    w = jnp.stack([high, low])[None]
    got = outputs_first_product(x, w)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.asarray([[a]]).astype(BF16)))


@kernel_only
def test_subnormal_numbers_count_as_zero(path):
    """As the CPU's bfloat16 dot product takes them (below 2^-126, about 1.2e-38): XLA's
    product keeps them."""
    tiny = jnp.asarray([[2.0**-130, 2.0**-127]], BF16)
    assert np.asarray(bf16_rows.product(jnp.ones((1, 2), BF16), tiny)).tolist() == [[0.0]]


@kernel_only
def test_a_row_has_the_same_bits_in_any_batch(path):
    x, w = operands(15, (300,), (256,))
    product = jax.jit(bf16_rows.product)
    batch = np.asarray(product(x, w))
    for row in range(15):
        np.testing.assert_array_equal(np.asarray(product(x[row : row + 1], w))[0], batch[row])
    for start, stop in ((0, 8), (3, 7), (9, 11)):
        np.testing.assert_array_equal(np.asarray(product(x[start:stop], w)), batch[start:stop])


@kernel_only
def test_its_gradient_is_xla_s_product_s(path):
    x, w = operands(4, (48,), (64,))
    dy = jax.random.normal(jax.random.key(1), (4, 48)).astype(BF16)

    def xla(x, w):
        product = jax.lax.dot_general(
            x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )
        return product.astype(BF16)

    ours = jax.vjp(bf16_rows.product, x, w)[1](dy)
    theirs = jax.vjp(xla, x, w)[1](dy)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype == BF16
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.fixture(scope="module")
def bf16_decoder():
    return loaded(FIXTURES / "qwen3-tiny", param_dtype="bf16")[0]


@pytest.fixture(scope="module")
def f32_decoder():
    return loaded(FIXTURES / "qwen3-tiny")[0]


def greedy(model, prompts, rows: int, new: int = 8) -> list[list[int]]:
    session = Session(model, rows, 128)
    return [row.tokens for row in session.generate(prompts, new, Sampling(temperature=0))]


def test_a_bf16_decoder_decodes_through_it_and_a_ragged_batch_writes_what_each_prompt_does_alone(
    path, bf16_decoder, monkeypatch
):
    prompts = [np.arange(3 + 9 * i, dtype=np.int32) % 200 + 1 for i in range(5)]
    taken = []
    product = bf16_rows.product
    monkeypatch.setattr(bf16_rows, "product", lambda *a: taken.append(a[0].shape) or product(*a))
    with on_mesh(ONE_DEVICE):
        batch = greedy(bf16_decoder, prompts, rows=8)
        alone = [greedy(bf16_decoder, [p], rows=1)[0] for p in prompts]
    assert batch == alone
    if path == KERNEL:
        # Each decoding step's projections (8 rows, then 1) and its logits went through it.
        assert {(8, 1, 32), (1, 1, 32)} <= set(taken)
    else:
        assert taken == []


def step_logits(model, prompt: np.ndarray, token: int) -> np.ndarray:
    """The logits (float32, the vocabulary's) of one decoding step: `token` after `prompt`."""

    def prefill_and_step(model, prompt, token):
        start = jnp.zeros(1, jnp.int32)
        cache = model.empty_cache(1, 32)
        prefill = Slots(jnp.int32(0), start, prefill=True)
        cache = model.decode(prompt[None], cache, prefill, last_only=True)[1]
        step = Slots(jnp.int32(prompt.shape[0]), start, prefill=False)
        return model.decode(token[None, None], cache, step)[0][0, 0, : model.vocab_size]

    with on_mesh(ONE_DEVICE):
        logits = nnx.jit(prefill_and_step)(model, jnp.asarray(prompt), jnp.int32(token))
    return np.asarray(logits, np.float32)


def test_a_bf16_decoding_step_gives_the_float32_model_s_logits_to_bf16_precision(
    path, bf16_decoder, f32_decoder
):
    """Two layers of bfloat16 (8 significant bits, each rounding 2^-9 at most): within 2^-5 of
    the largest logit, the same token first (measured: 0.018 of 1.83 on both paths)."""
    prompt = np.arange(1, 12, dtype=np.int32)
    low, high = (step_logits(m, prompt, 7) for m in (bf16_decoder, f32_decoder))
    assert np.abs(low - high).max() <= 2.0**-5 * np.abs(high).max()
    assert low.argmax() == high.argmax()


@kernel_only
def test_on_a_mesh_or_switched_off_xla_s_product_is_taken(path, monkeypatch):
    x, w = operands(2, (64,), (32,))
    assert bf16_rows.TARGET in program(x, w)
    with on_mesh(MESH):
        assert bf16_rows.TARGET not in program(x, w)
    monkeypatch.setenv(bf16_rows.SWITCH_ENV, "0")
    monkeypatch.setattr(bf16_rows, "available", bf16_rows.available.__wrapped__)
    assert bf16_rows.TARGET not in program(x, w)


def test_a_machine_without_a_compiler_decodes_at_xla_s_speed_and_is_told(
    tmp_path, monkeypatch, caplog
):
    """On a CPU with AVX-512 BF16 (the check says yes, on any machine: the compiler fails
    first)."""
    monkeypatch.setattr(bf16_rows, "_cpu_has_bf16_dot", lambda: True)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(bf16_rows.CACHE_ENV, str(tmp_path / "kernels"))
    monkeypatch.setattr(bf16_rows, "available", bf16_rows.available.__wrapped__)
    with caplog.at_level(logging.WARNING, logger="zoo"):
        assert not bf16_rows.available()
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "no-such-compiler" in warning and bf16_rows.SWITCH_ENV in warning
    monkeypatch.setenv(bf16_rows.SWITCH_ENV, "0")
    caplog.clear()
    assert not bf16_rows.available() and not caplog.records


def test_a_switch_value_other_than_0_or_1_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(bf16_rows.SWITCH_ENV, "off")
    monkeypatch.setattr(bf16_rows, "available", bf16_rows.available.__wrapped__)
    with pytest.raises(ZooError, match="ZOO_NATIVE_KERNELS='off'"):
        bf16_rows.available()


def test_a_cpu_without_avx512_bf16_is_not_told_and_compiles_nothing(tmp_path, monkeypatch, caplog):
    """Nothing to install would help it: no warning, no compiler run, no kernel cache."""
    monkeypatch.setattr(bf16_rows, "_cpu_has_bf16_dot", lambda: False)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv(bf16_rows.CACHE_ENV, str(tmp_path / "kernels"))
    monkeypatch.setattr(bf16_rows, "available", bf16_rows.available.__wrapped__)
    with caplog.at_level(logging.WARNING, logger="zoo"):
        assert not bf16_rows.available()
    assert not caplog.records and not (tmp_path / "kernels").exists()

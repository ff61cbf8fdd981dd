"""zoo.engine.bf16_rows: the bfloat16 product of a few rows by a kernel held outputs first, on the
CPU's bfloat16 dot products (this machine's CPU has them: the kernel is compiled and taken here).
It is the float32 sum of the exact products of the bfloat16 operands to within float32 rounding,
rounded to bfloat16 as XLA rounds, for every row count and remainder of the kernel's tiles and a contraction that is not a multiple
of its 32-wide vectors; a row has the same bits in any batch; its gradient is XLA's product's;
a bfloat16 decoder's decoding step takes it, and a ragged batch decoded greedily writes what each
prompt writes alone; on a mesh of several devices, or switched off, XLA's product is taken."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance.checks import MESH, ONE_DEVICE, on_mesh
from pretrained_checks import FIXTURES, loaded
from zoo.engine import bf16_rows
from zoo.engine.dense import FEW_ROWS, outputs_first_product
from zoo.engine.errors import ZooError
from zoo.models.generation import Sampling, Session

BF16 = jnp.bfloat16


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert bf16_rows.available()


def operands(rows: int, outputs: tuple[int, ...], inputs: tuple[int, ...], seed: int = 0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (rows, *inputs)).astype(BF16)
    w = jax.random.normal(kw, (*outputs, *inputs)).astype(BF16)
    return x, w


def float64_product(x, w, inputs: int):
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    axes = (list(range(x64.ndim - inputs, x64.ndim)), list(range(w64.ndim - inputs, w64.ndim)))
    return np.tensordot(x64, w64, axes), np.tensordot(np.abs(x64), np.abs(w64), axes)


def test_the_kernel_is_compiled_and_taken_on_this_cpu():
    """The suite's machine has AVX-512 BF16 and a compiler: a silent fallback would leave the
    kernel untested."""
    assert bf16_rows.available()
    x, w = operands(8, (64,), (32,))
    assert bf16_rows.applies(x, w)
    assert not bf16_rows.applies(x.astype(jnp.float32), w.astype(jnp.float32))
    assert bf16_rows.TARGET in jax.jit(outputs_first_product).lower(x, w).as_text()
    many = operands(FEW_ROWS + 1, (64,), (32,))[0]  # more rows than a decoding step's: XLA's
    assert bf16_rows.TARGET not in jax.jit(outputs_first_product).lower(many, w).as_text()


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 15])
@pytest.mark.parametrize(
    ("outputs", "inputs"), [((131,), (100,)), ((4, 8), (64,)), ((24,), (2, 48))]
)
def test_the_product_is_the_float32_sum_of_the_exact_products(rows, outputs, inputs):
    """Every row tile (8, 4, 2, 1 rows) and output remainder; 100 and 96 inputs are not whole
    32-wide vectors; several output (heads x head size) or input axes. Float32 rounding of a
    sum of k terms: under k x 2^-24 of the sum of their magnitudes; then bfloat16's rounding."""
    x, w = operands(rows, outputs, inputs)
    got = np.asarray(bf16_rows.product(x, w, len(inputs)), np.float64)
    want, scale = float64_product(x, w, len(inputs))
    assert got.shape == want.shape == (rows, *outputs)
    terms = np.prod(inputs)
    bound = 2.0**-8 * np.abs(want) + terms * 2.0**-24 * scale
    assert (np.abs(got - want) <= bound).all()


@pytest.mark.parametrize(
    "exact", [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1.5 * 2**127 + 2**119, 1 + 2**-7 + 2**-12]
)
def test_the_float32_sum_is_rounded_to_bfloat16_as_xla_rounds_it(exact):
    """Sums exact in float32: halfway between two bfloat16 numbers (to even: down, then up),
    negative, halfway near the largest, above halfway."""
    a = np.float32(exact)
    high = jnp.asarray(a, BF16)
    low = jnp.asarray(np.float32(a - np.float32(high)), BF16)  # a = high + low, exactly
    assert np.float32(high) + np.float32(low) == a
    x = jnp.ones((1, 2), BF16)
    w = jnp.stack([high, low])[None]
    got = bf16_rows.product(x, w)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.asarray([[a]]).astype(BF16)))


def test_subnormal_numbers_count_as_zero():
    """As the CPU's bfloat16 dot product takes them (below 2^-126, about 1.2e-38): XLA's
    product keeps them."""
    tiny = jnp.asarray([[2.0**-130, 2.0**-127]], BF16)
    assert np.asarray(bf16_rows.product(jnp.ones((1, 2), BF16), tiny)).tolist() == [[0.0]]


def test_a_row_has_the_same_bits_in_any_batch():
    x, w = operands(15, (300,), (256,))
    product = jax.jit(bf16_rows.product)
    batch = np.asarray(product(x, w))
    for row in range(15):
        np.testing.assert_array_equal(np.asarray(product(x[row : row + 1], w))[0], batch[row])
    for start, stop in ((0, 8), (3, 7), (9, 11)):
        np.testing.assert_array_equal(np.asarray(product(x[start:stop], w)), batch[start:stop])


def test_its_gradient_is_xla_s_product_s():
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


def greedy(model, prompts, rows: int, new: int = 8) -> list[list[int]]:
    session = Session(model, rows, 128)
    return [row.tokens for row in session.generate(prompts, new, Sampling(temperature=0))]


def test_a_bf16_decoder_decodes_through_it_and_a_ragged_batch_writes_what_each_prompt_does_alone(
    bf16_decoder, monkeypatch
):
    prompts = [np.arange(3 + 9 * i, dtype=np.int32) % 200 + 1 for i in range(5)]
    taken = []
    product = bf16_rows.product
    monkeypatch.setattr(bf16_rows, "product", lambda *a: taken.append(a[0].shape) or product(*a))
    with on_mesh(ONE_DEVICE):
        batch = greedy(bf16_decoder, prompts, rows=8)
        alone = [greedy(bf16_decoder, [p], rows=1)[0] for p in prompts]
    assert batch == alone
    # Each decoding step's projections (8 rows, then 1) and its logits went through the kernel.
    assert {(8, 1, 32), (1, 1, 32)} <= set(taken)


def test_on_a_mesh_or_switched_off_xla_s_product_is_taken(monkeypatch):
    x, w = operands(2, (64,), (32,))

    def program() -> str:  # traced anew each time
        return jax.jit(lambda x, w: outputs_first_product(x, w)).lower(x, w).as_text()

    assert bf16_rows.TARGET in program()
    with on_mesh(MESH):
        assert bf16_rows.TARGET not in program()
    monkeypatch.setattr(bf16_rows, "available", lambda: False)
    assert bf16_rows.TARGET not in program()


def test_a_machine_without_a_compiler_decodes_at_xla_s_speed_and_is_told(
    tmp_path, monkeypatch, caplog
):
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

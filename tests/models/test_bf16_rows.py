"""zoo.engine.kernels.bf16_rows and its fallback (zoo.engine.kernels.widened): the bfloat16 product
of a few rows by a kernel held outputs first, as a decoding step takes it.

Every test that takes a `path` runs on each of the kernel's variants (`avx512_bf16`, `avx512f`,
`avx2`: each skipped, naming the instructions, on a CPU that lacks them) and on the fallback a
CPU without any takes (float32 copies of the weights, made once by a decoding session), each
forced in turn, so a machine that has them all checks all four. On every path the product is the
float32 sum of the exact products of the bfloat16 operands to within float32 rounding, rounded
to bfloat16 as XLA rounds, for every row count and remainder of the kernel's tiles and a
contraction that is not a multiple of its vectors, and a bfloat16 decoder decodes through it: a
ragged batch decoded greedily writes what each prompt writes alone, and a decoding step's logits
are the float32 model's to bfloat16's precision. The kernel's own: a row has the same bits in any
batch, its gradient is XLA's product's, and on a mesh of several devices, or switched off, it is
not taken. Its cache: a library is loaded only if its bytes hash to the digest recorded when it
was built, from a directory no one else writes to, under a key that names the compiler's
version; without a compiler, the fallback is taken and said."""

from __future__ import annotations

import functools
import hashlib
import logging
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance.checks import MESH, ONE_DEVICE, on_mesh
from flax import nnx
from pretrained_checks import FIXTURES, loaded
from zoo.engine.errors import ZooError
from zoo.engine.kernels import bf16_rows, widened
from zoo.engine.kernels.dense import FEW_ROWS, outputs_first_product
from zoo.models.kv_cache import Slots
from zoo.models.sampling_loop import Sampling, Session

BF16 = jnp.bfloat16
FALLBACK = "float32 copies"
VARIANTS = list(bf16_rows.VARIANTS)
CHOSEN, LOAD = bf16_rows.chosen, bf16_rows.load  # as the module has them, cached per process


def why_it_cannot_run(variant: str) -> str | None:
    """Why this machine cannot run `variant` (a reason to skip its tests with), or None."""
    if lacking := bf16_rows.missing(variant):
        return f"this CPU lacks {', '.join(lacking)} (/proc/cpuinfo), which {variant} needs"
    if bf16_rows._compiler() is None:
        return "no C++ compiler (c++, g++ or $CXX) to compile the kernel with"
    return None


@pytest.fixture(scope="module")
def built() -> dict[str, Path]:
    """Each variant this machine runs, compiled (side by side: two cores) and registered, with
    its library in the session's kernel cache."""
    names = [v for v in VARIANTS if why_it_cannot_run(v) is None]
    with ThreadPoolExecutor(2) as pool:
        libraries = dict(zip(names, pool.map(bf16_rows._library, names), strict=True))
    return {v: Path(library._name) for v, library in libraries.items() if LOAD(v)}


@pytest.fixture(scope="module", params=[*VARIANTS, FALLBACK])
def path(request, built):
    """A variant forced (the one every decoding product takes), or FALLBACK: what a CPU where
    none runs takes. jax's caches are cleared on the way in and out so that no program traced
    on another path is reused."""
    if request.param in VARIANTS:
        if reason := why_it_cannot_run(request.param):
            pytest.skip(reason)
        assert request.param in built
    with pytest.MonkeyPatch.context() as patch:
        choice = None if request.param == FALLBACK else request.param
        patch.setattr(bf16_rows, "chosen", lambda: choice)
        jax.clear_caches()
        yield request.param
    jax.clear_caches()


kernel_only = pytest.mark.parametrize("path", VARIANTS, indirect=True)


def operands(rows: int, outputs: tuple[int, ...], inputs: tuple[int, ...], seed: int = 0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (rows, *inputs)).astype(BF16)
    w = jax.random.normal(kw, (*outputs, *inputs)).astype(BF16)
    return x, w


def float64_product(x, w, inputs: int):
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    axes = (list(range(x64.ndim - inputs, x64.ndim)), list(range(w64.ndim - inputs, w64.ndim)))
    return np.tensordot(x64, w64, axes), np.tensordot(np.abs(x64), np.abs(w64), axes)


def stepped(x, w, inputs: int = 1):
    """A dense layer's product as a decoding session's step traces it: with the float32 copy the
    session makes of `w` (none where the kernel runs)."""
    copies = widened.copies([w])

    def step(x, w, copies):
        with widened.reading([w], copies):
            return outputs_first_product(x, w, inputs)

    return jax.jit(step).lower(x, w, copies)


def test_each_path_takes_its_own_product(path):
    """A variant: its FFI call, and no dot. The fallback: a product of float32 operands (the
    copy), no bfloat16 one, no FFI call. More rows than a decoding step's: XLA's, on every path."""
    x, w = operands(8, (64,), (32,))
    assert bf16_rows.applies(x, w) == (path != FALLBACK)
    assert not bf16_rows.applies(x.astype(jnp.float32), w.astype(jnp.float32))
    text = stepped(x, w).as_text()
    for variant in VARIANTS:
        assert (f"@{bf16_rows.TARGET}_{variant}(" in text) == (variant == path)
    assert ("dot_general" in text) == (path == FALLBACK)
    if path == FALLBACK:
        dot = next(line for line in text.splitlines() if "dot_general" in line)
        assert "bf16" not in dot.rpartition(":")[2].partition("->")[0]
    many = operands(FEW_ROWS + 1, (64,), (32,))[0]
    assert bf16_rows.TARGET not in stepped(many, w).as_text()


@pytest.mark.parametrize("rows", [1, 3, 8, 15])
@pytest.mark.parametrize(
    ("outputs", "inputs"), [((131,), (100,)), ((4, 8), (64,)), ((24,), (2, 48))]
)
def test_the_product_is_the_float32_sum_of_the_exact_products(path, rows, outputs, inputs):
    """Every row tile (15 rows: 8, 4, 2, 1) and output remainder; 100 and 96 inputs
    are not whole vectors (32 or 16 wide); several output (heads x head size) or input axes.
    Float32 rounding of a sum of k terms: under k x 2^-24 of the sum of their magnitudes; then
    bfloat16's rounding."""
    x, w = operands(rows, outputs, inputs)
    got = np.asarray(stepped(x, w, len(inputs)).compile()(x, w, widened.copies([w])), np.float64)
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
    got = stepped(x, w).compile()(x, w, widened.copies([w]))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.asarray([[a]]).astype(BF16)))


@kernel_only
def test_subnormal_numbers_are_taken_as_xla_takes_them(path):
    """As zero (below 2^-126, about 1.2e-38): the bfloat16 dot product instruction flushes them,
    and XLA's threads, on which every variant runs, flush a float32 FMA's."""
    tiny = jnp.asarray([[2.0**-130, 2.0**-127]], BF16)
    x = jnp.ones((1, 2), BF16)
    assert np.asarray(bf16_rows.product(x, tiny)).tolist() == [[0.0]]
    assert np.asarray(bf16_rows._reference(x, tiny)).tolist() == [[0.0]]


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
    kernel, copied = [], []
    product, copy_of = bf16_rows.product, widened.copy_of
    monkeypatch.setattr(bf16_rows, "product", lambda *a: kernel.append(a[0].shape) or product(*a))
    monkeypatch.setattr(
        widened, "copy_of", lambda k: (c := copy_of(k), c is None or copied.append(k.shape))[0]
    )
    with on_mesh(ONE_DEVICE):
        batch = greedy(bf16_decoder, prompts, rows=8)
        alone = [greedy(bf16_decoder, [p], rows=1)[0] for p in prompts]
    assert batch == alone
    # Each decoding step's projections (8 rows, then 1) and its logits went through the path.
    if path == FALLBACK:
        vocabulary = bf16_decoder.embedding[...].shape
        assert kernel == [] and vocabulary in copied and (32, 64) in copied
    else:
        assert {(8, 1, 32), (1, 1, 32)} <= set(kernel)


def step_logits(model, prompt: np.ndarray, token: int) -> np.ndarray:
    """The logits (float32, the vocabulary's) of one decoding step, `token` after `prompt`,
    traced as a session traces it (with its float32 copies where the kernel does not run)."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)

    def prefill_and_step(leaves, copies, prompt, token):
        with widened.reading(leaves, copies):
            model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
            start = jnp.zeros(1, jnp.int32)
            cache = model.empty_cache(1, 32)
            prefill = Slots(jnp.int32(0), start, prefill=True)
            cache = model.decode(prompt[None], cache, prefill, last_only=True)[1]
            step = Slots(jnp.int32(prompt.shape[0]), start, prefill=False)
            return model.decode(token[None, None], cache, step)[0][0, 0, : model.vocab_size]

    with on_mesh(ONE_DEVICE):
        copies = widened.copies(leaves)
        logits = jax.jit(prefill_and_step)(leaves, copies, jnp.asarray(prompt), jnp.int32(token))
    return np.asarray(logits, np.float32)


def test_a_bf16_decoding_step_gives_the_float32_model_s_logits_to_bf16_precision(
    path, bf16_decoder, f32_decoder
):
    """Two layers of bfloat16 (8 significant bits, each rounding 2^-9 at most): within 2^-5 of
    the largest logit, the same token first (measured: 0.018 of 1.83 on every path)."""
    prompt = np.arange(1, 12, dtype=np.int32)
    low, high = (step_logits(m, prompt, 7) for m in (bf16_decoder, f32_decoder))
    assert np.abs(low - high).max() <= 2.0**-5 * np.abs(high).max()
    assert low.argmax() == high.argmax()


def test_the_copies_are_made_once_and_shared_while_held(path, bf16_decoder):
    """By the sessions over the same weights; none where the kernel runs, none of a float32
    weight or a vector."""
    leaves = jax.tree.leaves(nnx.state(bf16_decoder))
    first, second = widened.copies(leaves), widened.copies(leaves)
    if path != FALLBACK:
        assert set(first) == {None}
        return
    made = [(w, c) for w, c in zip(leaves, first, strict=True) if c is not None]
    assert made and all(w.ndim >= 2 and c.dtype == jnp.float32 for w, c in made)
    assert all(a is b for a, b in zip(first, second, strict=True))
    for w, c in made:
        np.testing.assert_array_equal(np.asarray(c), np.asarray(w, np.float32))
    assert widened.copies([jnp.ones((4, 4)), jnp.ones(4, BF16)]) == (None, None)


FASTEST = bf16_rows.runnable()[:1] or VARIANTS[-1:]
"""The variant this CPU takes unless told (else one to skip with, naming what it lacks)."""


@pytest.mark.parametrize("path", FASTEST, indirect=True)
def test_on_a_mesh_or_switched_off_the_kernel_is_not_taken(path, monkeypatch):
    x, w = operands(2, (64,), (32,))
    assert bf16_rows.TARGET in stepped(x, w).as_text()
    with on_mesh(MESH):
        assert bf16_rows.TARGET not in stepped(x, w).as_text()
    monkeypatch.setenv(bf16_rows.SWITCH_ENV, "0")
    monkeypatch.setattr(bf16_rows, "chosen", functools.cache(CHOSEN.__wrapped__))
    assert bf16_rows.TARGET not in stepped(x, w).as_text()


@pytest.mark.parametrize("path", [VARIANTS[-1]], indirect=True)
def test_a_variant_named_by_the_switch_is_taken(path, monkeypatch):
    monkeypatch.setenv(bf16_rows.SWITCH_ENV, path)
    monkeypatch.setattr(bf16_rows, "chosen", functools.cache(CHOSEN.__wrapped__))
    assert bf16_rows.chosen() == path


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """`chosen` and `load` asked anew, with a kernel cache of this test's own (a library loaded
    before stays registered: jax refuses a second registration of a name)."""
    monkeypatch.setenv(bf16_rows.CACHE_ENV, str(tmp_path / "kernels"))
    monkeypatch.setattr(bf16_rows, "chosen", functools.cache(CHOSEN.__wrapped__))
    monkeypatch.setattr(bf16_rows, "load", functools.cache(LOAD.__wrapped__))
    monkeypatch.setattr(bf16_rows, "_FAILURES", {})
    return tmp_path / "kernels"


def test_without_a_compiler_decoding_takes_the_copies_and_is_told(fresh, monkeypatch, caplog):
    monkeypatch.setenv("CXX", str(fresh.parent / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="zoo"):
        assert widened.copies([jnp.ones((8, 4))]) == (None,)  # float32: nothing to say
        assert not caplog.records
        assert bf16_rows.chosen() is None
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "no-such-compiler" in warning and bf16_rows.SWITCH_ENV in warning
    assert "float32 copies" in warning
    (copy,) = widened.copies([jnp.ones((8, 4), BF16)])
    assert copy.dtype == jnp.float32
    monkeypatch.setenv(bf16_rows.SWITCH_ENV, "0")
    monkeypatch.setattr(bf16_rows, "chosen", functools.cache(CHOSEN.__wrapped__))
    caplog.clear()
    assert bf16_rows.chosen() is None and not caplog.records


@pytest.mark.parametrize("switch", ["off", "avx512"])
def test_a_switch_value_zoo_does_not_know_is_refused_by_name(fresh, monkeypatch, switch):
    monkeypatch.setenv(bf16_rows.SWITCH_ENV, switch)
    with pytest.raises(ZooError, match=f"ZOO_NATIVE_KERNELS='{switch}'.*avx512_bf16, avx512f"):
        bf16_rows.chosen()


def test_a_variant_the_cpu_lacks_is_refused_naming_the_instructions(fresh, monkeypatch):
    monkeypatch.setattr(bf16_rows, "_cpu_flags", lambda: frozenset({"avx2", "fma"}))
    monkeypatch.setenv(bf16_rows.SWITCH_ENV, "avx512f")
    with pytest.raises(ZooError, match="lacks avx512f, avx512bw.*Variants it runs: avx2"):
        bf16_rows.chosen()


def test_a_cpu_with_no_variant_is_not_told_and_compiles_nothing(fresh, monkeypatch, caplog):
    """An Arm or macOS machine: nothing to install would help it."""
    monkeypatch.setattr(bf16_rows, "_cpu_flags", frozenset)
    monkeypatch.setenv("CXX", str(fresh.parent / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger="zoo"):
        assert bf16_rows.chosen() is None
    assert not caplog.records and not fresh.exists()


FAKE_COMPILER = """#!/bin/sh
# A stand-in for a C++ compiler: says its version, and "compiles" by copying a library built
# before, noting each build in a log.
[ "$1" = --version ] && {{ echo "{version}"; exit 0; }}
while [ $# -gt 1 ]; do [ "$1" = -o ] && out=$2; shift; done
echo built >> "{log}"
cp "{library}" "$out"
"""


@pytest.fixture
def compiler(fresh, built, monkeypatch):
    """A compiler that "builds" the avx2 library compiled for the session in a moment (a real
    compilation takes seconds): `make(version)` writes one and sets `$CXX` to it; `builds()`
    counts its builds."""
    if not built:
        pytest.skip("no variant of the kernel runs on this machine")
    library = built.get("avx2", next(iter(built.values())))
    log = fresh.parent / "builds.log"

    class Compiler:
        def make(self, version: str, name: str = "c++") -> str:
            path = fresh.parent / f"{name}-{hashlib.sha256(version.encode()).hexdigest()[:8]}"
            path.write_text(FAKE_COMPILER.format(version=version, log=log, library=library))
            path.chmod(0o755)
            monkeypatch.setenv("CXX", str(path))
            return str(path)

        def builds(self) -> int:
            return len(log.read_text().splitlines()) if log.exists() else 0

    return Compiler()


def test_a_library_changed_after_its_build_is_compiled_again_not_loaded(compiler, fresh, caplog):
    compiler.make("c++ 12.2.0")
    first = Path(bf16_rows._library("avx2")._name)
    assert compiler.builds() == 1 and bf16_rows.intact(first)
    assert bf16_rows._library("avx2")._name == str(first) and compiler.builds() == 1
    with first.open("ab") as appended:  # the same name, other bytes (those loaded unchanged)
        appended.write(b"\0")
    assert not bf16_rows.intact(first)
    with caplog.at_level(logging.WARNING, logger="zoo"):
        again = Path(bf16_rows._library("avx2")._name)
    assert compiler.builds() == 2 and bf16_rows.intact(again)
    assert [p for p in fresh.iterdir() if p.suffix == ".so"] == [again]
    assert str(first) in caplog.text and "compiled again, not loaded" in caplog.text


def test_the_cache_key_names_the_compiler_s_version_not_its_path(compiler):
    twelve = compiler.make("c++ (Debian 12.2.0-14) 12.2.0", name="c++")
    same = compiler.make("c++ (Debian 12.2.0-14) 12.2.0", name="g++")
    thirteen = compiler.make("c++ (Debian 13.1.0-1) 13.1.0")
    keys = {c: bf16_rows.cache_key("avx2", c) for c in (twelve, same, thirteen)}
    assert keys[twelve] == keys[same] != keys[thirteen]
    assert bf16_rows.cache_key("avx2", twelve) != bf16_rows.cache_key("avx512f", twelve)


def test_a_cache_others_can_write_to_is_not_used(compiler, fresh, caplog):
    compiler.make("c++ 12.2.0")
    fresh.mkdir()
    fresh.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="zoo"):
        library = bf16_rows._library("avx2")
    assert library.ZooBf16Supported() and compiler.builds() == 1
    assert not list(fresh.iterdir()) and "can be written by other users" in caplog.text
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o777

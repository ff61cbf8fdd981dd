"""zoo.engine.kernels.cpu_dot: a dense layer's bfloat16 product on a CPU, forward and backward, equals the
float32 product of the same bfloat16 operands to within one bfloat16 rounding, on one device
and split over a mesh, with the kernel held inputs first (`nnx.Linear`'s) or outputs first
(`TransposedLinear`'s), gives the same bits when rerun, and reaches XLA:CPU's products with
bfloat16 operands and a float32 result, which it runs on the CPU's bfloat16 instructions (where
`jax.lax.dot_general`'s are widened to float32 by jaxlib 0.10's XLA, and kept in bfloat16 with a
bfloat16 result, a slower product still, by jaxlib 0.12's), in the shared transformer block and
in the decoder's. A float32 kernel, held either way, gives float32's
product and gradients, whichever way its kernel gradient is taken."""

from __future__ import annotations

import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance.checks import MESH, on_mesh
from flax import nnx
from zoo.engine.kernels import cpu_dot
from zoo.engine.sharding.mesh import logical_spec
from zoo.engine.steps.precision import lowered
from zoo.models.decoder import Decoder
from zoo.models.decoder_options import DecoderOptions
from zoo.models.layers import dense, head_projections
from zoo.models.text_completion import generate_tokens

from zoo.plugin import TransposedLinear

BF16 = jnp.bfloat16
# x (batch..., inputs...) and w (inputs..., outputs...), contracting `k` axes: a Linear layer's,
# attention's query projection (outputs split into heads) and its output projection (inputs).
CASES = {
    "linear": ((4, 24, 48), (48, 80), 1),
    "heads out": ((4, 24, 48), (48, 4, 16), 1),
    "heads in": ((4, 24, 4, 16), (4, 16, 48), 2),
}


def operands(x_shape, w_shape, seed=0):
    kx, kw, kd = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, x_shape).astype(BF16)
    w = (jax.random.normal(kw, w_shape) / np.sqrt(np.prod(w_shape[:-1]))).astype(BF16)
    return x, w, kd


# How the layer holds its kernel: inputs first (`cpu_dot.product`, an `nnx.Linear`'s) or outputs
# first (a `TransposedLinear`, which holds the transpose of the same w).
HELD = ["inputs first", "outputs first"]


def held_outputs_first(w, k):
    return jnp.transpose(w, (*range(k, w.ndim), *range(k)))


def transposed_linear(x, held, k):
    """`TransposedLinear`'s call with the kernel `held` (outputs..., inputs...) and no bias, on x
    (as LoRA calls it with a kernel of its own, `zoo.engine.weights.lora`)."""
    inputs, outputs = held.shape[held.ndim - k :], held.shape[: held.ndim - k]
    layer = SimpleNamespace(kernel=held, bias=None, in_features=inputs, out_features=outputs)
    return TransposedLinear.__call__(layer, x)


def linear(x, w, k):
    """`nnx.Linear`'s call with the kernel w (inputs..., outputs...) and no bias, on x."""
    numbers = ((tuple(range(x.ndim - k, x.ndim)), tuple(range(k))), ((), ()))
    return cpu_dot.dot_general(x, w, numbers)


def products(x, w, k, dy, held="inputs first"):
    """y, dx, dw of the layer for the cotangent dy, dw laid out as w (inputs..., outputs...)."""
    if held == "inputs first":
        y, pullback = jax.vjp(lambda x, w: linear(x, w, k), x, w)
        return (y, *pullback(dy))
    held_w = held_outputs_first(w, k)
    y, pullback = jax.vjp(lambda x, held_w: transposed_linear(x, held_w, k), x, held_w)
    dx, dheld = pullback(dy)
    outputs = w.ndim - k
    return y, dx, jnp.transpose(dheld, (*range(outputs, w.ndim), *range(outputs)))


def reference(x, w, k, dy):
    """The same three products in float32 from the same bfloat16 operands (each exact product
    of two bfloat16 numbers is a float32 number), each with |a| . |b| beside it."""
    f32 = [np.asarray(a, np.float64) for a in (x, w, dy)]
    x64, w64, dy64 = f32
    xa = x64.ndim - k
    y = np.tensordot(x64, w64, k)
    dx = np.tensordot(dy64, w64, (list(range(xa, dy64.ndim)), list(range(k, w64.ndim))))
    dw = np.tensordot(x64, dy64, (list(range(xa)), list(range(xa))))
    scale_y = np.tensordot(np.abs(x64), np.abs(w64), k)
    scale_dx = np.tensordot(
        np.abs(dy64), np.abs(w64), (list(range(xa, dy64.ndim)), list(range(k, w64.ndim)))
    )
    scale_dw = np.tensordot(np.abs(x64), np.abs(dy64), (list(range(xa)), list(range(xa))))
    return (y, scale_y), (dx, scale_dx), (dw, scale_dw)


def assert_within_bf16_rounding(got, want, scale):
    """|got - want| <= 2^-8 |want| + 2^-16 (|a| . |b|): the result's one rounding to bfloat16
    (at most half its spacing, 2^-9 of it, doubled for the float32 sum it rounds) and the float32
    sum's own error, at most (terms) x 2^-24 x the sum of the terms' magnitudes, under 2^-16 of
    it for the 256 terms at most summed here."""
    got = np.asarray(got, np.float64)
    bound = 2.0**-8 * np.abs(want) + 2.0**-16 * scale
    excess = np.abs(got - want) - bound
    assert excess.max() <= 0, f"off by {excess.max():.3g} beyond bfloat16 rounding"


def shaped_cotangent(x, w, k, key):
    y_shape = (*x.shape[: x.ndim - k], *w.shape[k:])
    return jax.random.normal(key, y_shape).astype(BF16)


@pytest.mark.parametrize("held", HELD)
@pytest.mark.parametrize("case", CASES)
def test_forward_and_gradients_are_the_bf16_product_to_within_its_rounding(case, held):
    x_shape, w_shape, k = CASES[case]
    x, w, key = operands(x_shape, w_shape)
    dy = shaped_cotangent(x, w, k, key)
    got = jax.jit(products, static_argnums=(2, 4))(x, w, k, dy, held)
    assert [a.dtype for a in got] == [BF16] * 3
    for value, (want, scale) in zip(got, reference(x, w, k, dy), strict=True):
        assert value.shape == want.shape
        assert_within_bf16_rounding(value, want, scale)
    # jax's own bfloat16 product is held to the same bound: the bound is bfloat16's, not ours.
    plain = jax.jit(
        lambda x, w: jax.lax.dot_general(
            x, w, ((tuple(range(x.ndim - k, x.ndim)), tuple(range(k))), ((), ()))
        )
    )(x, w)
    assert_within_bf16_rounding(plain, *reference(x, w, k, dy)[0])


def test_rerun_gives_the_same_bits():
    x_shape, w_shape, k = CASES["heads in"]
    x, w, key = operands(x_shape, w_shape)
    dy = shaped_cotangent(x, w, k, key)
    first = jax.jit(products, static_argnums=2)(x, w, k, dy)
    again = jax.jit(products, static_argnums=2)(x, w, k, dy)
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("held", HELD)
@pytest.mark.parametrize("case", ["linear", "heads in"])
def test_split_over_a_mesh_it_gives_the_bf16_product_with_the_operands_shardings(case, held):
    x_shape, w_shape, k = CASES[case]
    x, w, key = operands(x_shape, w_shape)
    dy = shaped_cotangent(x, w, k, key)
    with on_mesh(MESH):
        x_spec = logical_spec("batch", *(None,) * (x.ndim - 1))
        # The kernel split on its first input axis: `embed` (FSDP) for a Linear layer's, the
        # heads for the output projection's.
        w_spec = logical_spec("embed" if k == 1 else "heads", *(None,) * (w.ndim - 1))
        dy_spec = logical_spec("batch", *(None,) * (dy.ndim - 1))
        split = [jax.sharding.reshard(a, s) for a, s in ((x, x_spec), (w, w_spec), (dy, dy_spec))]
        got = jax.jit(products, static_argnums=(2, 4))(split[0], split[1], k, split[2], held)
        assert jax.typeof(got[1]).sharding.spec == x_spec
        assert jax.typeof(got[2]).sharding.spec == w_spec
    for value, (want, scale) in zip(got, reference(x, w, k, dy), strict=True):
        assert_within_bf16_rounding(value, want, scale)


@pytest.mark.parametrize("mesh", [None, MESH], ids=["one device", "mesh"])
@pytest.mark.parametrize("held", HELD)
@pytest.mark.parametrize("case", CASES)
def test_float32_kernels_are_the_product_and_its_gradients(case, held, mesh):
    """A float32 kernel with no more inputs than outputs, held either way, takes its gradient
    from the input copied transposed (`wide_outputs`), others stay jax's; either way the
    product and both gradients are float32's, with the operands' shardings on a mesh."""
    x_shape, w_shape, k = CASES[case]
    x, w = (a.astype(jnp.float32) for a in operands(x_shape, w_shape)[:2])
    dy = shaped_cotangent(x, w, k, jax.random.key(1)).astype(jnp.float32)
    wide = np.prod(w_shape[:k]) <= np.prod(w_shape[k:])
    if held == "inputs first":
        jaxpr = jax.make_jaxpr(lambda x, w: linear(x, w, k))(x, w)
    else:
        jaxpr = jax.make_jaxpr(lambda x, h: transposed_linear(x, h, k))(x, held_outputs_first(w, k))
    assert ("custom_vjp" in str(jaxpr)) == wide
    with on_mesh(mesh or {"data": 1, "fsdp": 1, "tensor": 1}):
        w_spec = logical_spec("embed" if k == 1 else "heads", *(None,) * (w.ndim - 1))
        x_spec = logical_spec("batch", *(None,) * (x.ndim - 1))
        dy_spec = logical_spec("batch", *(None,) * (dy.ndim - 1))
        split = [jax.sharding.reshard(a, s) for a, s in ((x, x_spec), (w, w_spec), (dy, dy_spec))]
        got = jax.jit(products, static_argnums=(2, 4))(split[0], split[1], k, split[2], held)
        assert jax.typeof(got[1]).sharding.spec == x_spec
        if held == "inputs first":
            assert jax.typeof(got[2]).sharding.spec == w_spec
    for value, (want, scale) in zip(got, reference(x, w, k, dy), strict=True):
        assert value.dtype == jnp.float32 and value.shape == want.shape
        np.testing.assert_array_less(np.abs(np.asarray(value, np.float64) - want), 2.0**-18 * scale)


def test_float32_and_other_products_are_jaxs_own():
    x = operands((4, 24, 48), (48, 80))[0]
    narrow = [a.astype(jnp.float32) for a in operands((4, 24, 80), (80, 48))[:2]]
    batched = x[:, :8].transpose(0, 2, 1)
    for operands_, numbers in (
        (narrow, (((2,), (0,)), ((), ()))),  # float32, more inputs than outputs
        ((x, batched), (((2,), (1,)), ((0,), (0,)))),  # a batched product: not a dense layer's
    ):
        ours = jax.make_jaxpr(cpu_dot.dot_general, static_argnums=2)(*operands_, numbers)
        jaxs = jax.make_jaxpr(jax.lax.dot_general, static_argnums=2)(*operands_, numbers)
        assert str(ours) == str(jaxs)


class Block(nnx.Module):
    """A Linear layer and attention's four projections, as the shared transformer block
    builds them (`zoo.models.layers`)."""

    def __init__(self, rngs):
        self.mlp = dense(32, 64, ("embed", "mlp"), rngs=rngs)
        self.query, _, _, self.out = head_projections(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(self.query(x)) + self.mlp(x)[..., :32]


BF16_PRODUCT = (["bf16", "bf16"], "f32")
"""The product that XLA:CPU runs on the CPU's bfloat16 instructions: bfloat16 operands, a
float32 result."""


def compiled_products(model, x):
    """(operand dtypes, result dtype) of every product in the compiled gradient of the sum of
    `model(x)`."""
    graph, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, x):
        return jnp.sum(nnx.merge(graph, params, rest)(x).astype(jnp.float32))

    text = jax.jit(jax.grad(loss)).lower(params, x).compile().as_text()
    computations = re.findall(r"\n%\S+ \(([^)]*)\) -> \S+ \{\n((?:.+\n)*?)\}", text)
    return [
        (re.findall(r": (\w+)\[", signature), dot.group(1))
        for signature, body in computations
        if (dot := re.search(r"= (\w+)\[\S* dot\(", body))
    ]


def test_the_dense_layers_products_and_their_gradients_reach_xla_in_bf16(monkeypatch):
    with on_mesh({"data": 1, "fsdp": 1, "tensor": 1}):
        model = Block(nnx.Rngs(0))
        graph, params = nnx.split(model)
        low = nnx.merge(graph, lowered(params))
        # 2,048 rows: XLA:CPU leaves products of a few rows to Eigen, in float32, when its Eigen
        # runs single-threaded (as the suite's conftest sets it).
        x = jnp.ones((8, 256, 32), BF16)
        ours = compiled_products(low, x)
        assert len(ours) >= 5 and all(product == BF16_PRODUCT for product in ours), ours
        monkeypatch.setattr(cpu_dot, "_on_bf16_path", lambda *_: False)
        widened = compiled_products(low, x)
        assert widened and BF16_PRODUCT not in widened, widened


def test_the_decoders_projections_and_their_gradients_reach_xla_in_bf16(monkeypatch):
    """A decoder layer's seven projections (query, key, value, output; gate, up, down), each
    with its two backward products: 21 products more are XLA:CPU's bfloat16 product
    (`BF16_PRODUCT`) than with `jax.lax.dot_general` alone. A decoding step of a few rows
    (`FEW_ROWS`) keeps the kernel-first product and still runs."""
    with on_mesh({"data": 1, "fsdp": 1, "tensor": 1}):
        options = DecoderOptions(vocab_size=256, context_length=256, dim=32, depth=1)
        model = Decoder(options, rngs=nnx.Rngs(0))
        graph, params, rest = nnx.split(model, nnx.Param, ...)
        low = nnx.merge(graph, lowered(params), rest)
        tokens = jnp.ones((8, 256), jnp.int32)

        ours = compiled_products(low, tokens).count(BF16_PRODUCT)
        monkeypatch.setattr(cpu_dot, "_on_bf16_path", lambda *_: False)
        widened = compiled_products(low, tokens).count(BF16_PRODUCT)
        monkeypatch.undo()
        assert ours - widened == 21, (ours, widened)
        new = generate_tokens(low, np.arange(8), max_new_tokens=4, temperature=0.0)
        assert new.shape == (4,) and ((new >= 0) & (new < 256)).all()

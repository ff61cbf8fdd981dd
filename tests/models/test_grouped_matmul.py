"""`zoo.models.grouped_matmul` against `jax.lax.ragged_dot_general`, the product it computes
(which XLA expands into a dense one): values and gradients, for routings from even to every row
in one group, with empty groups; and the memory its compiled program holds."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from zoo.models.grouped_matmul import grouped_matmul, tile_rows

RAGGED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)


def ragged(rows, kernels, sizes):
    return jax.lax.ragged_dot_general(rows, kernels, sizes, RAGGED)


@pytest.mark.parametrize(
    "sizes",
    [[0, 7, 13, 0], [5, 5, 5, 5], [20, 0, 0, 0], [0, 0, 0, 20], [1, 2, 3, 14], [3, 0, 4, 2]],
    ids=["empty-groups", "even", "all-first", "all-last", "uneven", "rows-past-the-groups"],
)
def test_values_and_gradients_are_ragged_dot_s(sizes):
    """The rows past the groups' (as an expert device's pairs of other devices' experts) come
    out zero and take no gradient, as `ragged_dot` gives them."""
    rng = np.random.default_rng(0)
    rows = jnp.asarray(rng.normal(size=(20, 12)), jnp.float32)
    kernels = jnp.asarray(rng.normal(size=(4, 5, 12)), jnp.float32)
    sizes = jnp.asarray(sizes, jnp.int32)

    def loss(product):
        return lambda r, k: jnp.sum(jnp.sin(product(r, k, sizes)))

    with jax.default_matmul_precision("highest"):
        ours = jax.jit(grouped_matmul)(rows, kernels, sizes)
        grads = jax.jit(jax.grad(loss(grouped_matmul), argnums=(0, 1)))(rows, kernels)
        expected = ragged(rows, kernels, sizes)
        expected_grads = jax.grad(loss(ragged), argnums=(0, 1))(rows, kernels)
    np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_work_grows_with_the_rows_not_with_the_experts():
    """The compiled product's temporaries: the rows laid out in tiles and their products,
    (rows + experts x (tile - 1)) rows at most, the products put back in row order, and one
    step's gathered kernels (at most max(8, experts / 4)); not a row per row and expert, as
    XLA's expansion of a ragged product holds (`benchmarks.experts`), nor a kernel per tile
    (with 128 experts 32 rows to a tile: 252 tiles, twice the experts' weights)."""
    rows, width, out = 4096, 64, 64
    for experts in (8, 64, 128):
        args = (
            jax.ShapeDtypeStruct((rows, width), jnp.float32),
            jax.ShapeDtypeStruct((experts, out, width), jnp.float32),
            jax.ShapeDtypeStruct((experts,), jnp.int32),
        )
        tile = tile_rows(rows, experts)
        laid_out = (rows + experts * tile) * (out + width) * 4 + rows * out * 4
        bound = laid_out + max(8, experts // 4) * out * width * 4
        ours = jax.jit(grouped_matmul).lower(*args).compile().memory_analysis()
        assert ours.temp_size_in_bytes <= bound < rows * experts * out * 4, experts

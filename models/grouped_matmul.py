"""The grouped matrix product of a mixture of experts: rows sorted by expert, each group of rows
times its expert's matrix, computing only what each expert was given.

`jax.lax.ragged_dot` states this product, but XLA computes it, wherever no grouped kernel takes
it (XLA:CPU; a GPU without its experimental cuDNN path), by expanding it into a dense product of
every row with every expert's matrix, masked: E times the work and the memory of the product
itself (`benchmarks.experts` measures both). `grouped_matmul` keeps the work to the rows given:
each group's rows are laid out from a tile boundary (`tile` rows to a tile; a group's last tile
padded with zero rows), every tile holds rows of one group, and one batched product multiplies
each tile by its group's matrix. The padding is at most `tile - 1` rows per group, so the work
is that of (rows + experts x (tile - 1)) rows, whatever the routing; the padded layout has a
size known when tracing, as XLA needs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LARGEST_TILE = 128
"""Rows per tile where groups are large: the batched product's matrices are then of a size
that matrix units run well, and the padding (at most 127 rows per group) small beside them."""


def tile_rows(rows: int, groups: int) -> int:
    """Rows per tile for `rows` split over `groups`: a power of two near the mean group's size,
    from 8 to `LARGEST_TILE`, so that small mixtures are not padded to mostly zeros."""
    mean = max(1, rows // max(groups, 1))
    return int(min(LARGEST_TILE, max(8, 1 << (mean - 1).bit_length())))


@jax.checkpoint
def grouped_matmul(rows: jax.Array, kernels: jax.Array, sizes: jax.Array) -> jax.Array:
    """rows [M, in] sorted by group, kernels [G, out, in] (each (out, in), as the checkpoints
    hold them), sizes [G] (the rows of each group, summing to M) -> [M, out]: each row times
    its group's kernel, transposed. The backward pass lays the rows and the tiles' kernels out
    again rather than keep them (`jax.checkpoint`): the tiles' kernels are about twice a
    layer's expert weights."""
    count, width = rows.shape
    groups = kernels.shape[0]
    tile = tile_rows(count, groups)
    tiles = -(-(count + groups * (tile - 1)) // tile)  # enough for any sizes summing to M
    padded = (sizes + tile - 1) // tile * tile
    padded_ends = jnp.cumsum(padded)
    group = jnp.repeat(jnp.arange(groups), sizes, total_repeat_length=count)
    slot = (padded_ends - padded)[group] + jnp.arange(count) - (jnp.cumsum(sizes) - sizes)[group]
    laid_out = jnp.zeros((tiles * tile, width), rows.dtype).at[slot].set(rows)
    tile_group = jnp.searchsorted(padded_ends, jnp.arange(tiles) * tile, side="right")
    tile_kernels = kernels[jnp.minimum(tile_group, groups - 1)]  # tiles past the last: zeros in
    products = jnp.einsum("tri,toi->tro", laid_out.reshape(tiles, tile, width), tile_kernels)
    return products.reshape(tiles * tile, -1)[slot]

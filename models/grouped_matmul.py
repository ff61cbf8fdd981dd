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
size known when tracing, as XLA needs. The tiles go through a few at a time, each with its
group's kernel gathered, so the gathered kernels never outgrow the experts' own; rows that no
group holds (sorted last) are skipped, a step of tiles at a time, so the work follows the rows
the groups hold, not the size of the arrays.
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


def tiles_per_step(tiles: int, groups: int) -> int:
    """How many tiles one step of the product multiplies: at most a quarter of the groups, so
    that the kernels gathered for a step (one per tile) stay a fraction of the experts' own,
    and at least 8 (or all of them), so that a step's product is not a sliver."""
    return max(1, min(tiles, max(8, groups // 4)))


@jax.checkpoint
def grouped_matmul(rows: jax.Array, kernels: jax.Array, sizes: jax.Array) -> jax.Array:
    """rows [M, in] sorted by group, kernels [G, out, in] (each (out, in), as the checkpoints
    hold them), sizes [G] (the rows of each group, summing to at most M) -> [M, out]: each row
    times its group's kernel, transposed; the rows past the groups' (M - sum(sizes), which no
    group holds) come out zero.

    The tiles are multiplied a few at a time (`tiles_per_step`, a `lax.scan`): each step
    gathers its tiles' kernels, so what is held is a step's kernels, not a kernel per tile (for
    Qwen3-30B-A3B's 128 experts and 4,096 tokens, 384 tiles: three times the layer's expert
    weights, kept per layer). A step whose tiles hold no group's rows is skipped (`lax.cond`,
    forward and backward), so the work follows the rows the groups hold, not M: an expert
    device computes the pairs of its own experts among every pair of its group. The backward
    pass lays the rows out again rather than keep them (`jax.checkpoint`)."""
    count, width = rows.shape
    groups = kernels.shape[0]
    tile = tile_rows(count, groups)
    tiles = -(-(count + groups * (tile - 1)) // tile)  # enough for any sizes summing to M
    step = tiles_per_step(tiles, groups)
    tiles = -(-tiles // step) * step
    held = jnp.arange(count) < jnp.sum(sizes)  # the rows some group holds
    padded = (sizes + tile - 1) // tile * tile
    padded_ends = jnp.cumsum(padded)
    group = jnp.repeat(jnp.arange(groups), sizes, total_repeat_length=count)
    slot = (padded_ends - padded)[group] + jnp.arange(count) - (jnp.cumsum(sizes) - sizes)[group]
    slot = jnp.where(held, slot, padded_ends[-1] + jnp.arange(count) - jnp.sum(sizes))
    laid_out = (
        jnp.zeros((tiles * tile, width), rows.dtype).at[slot].set(jnp.where(held[:, None], rows, 0))
    )
    starts = jnp.arange(tiles) * tile
    tile_group = jnp.searchsorted(padded_ends, starts, side="right")
    tile_group = jnp.minimum(tile_group, groups - 1)  # tiles past the last: zeros in
    step_used = (starts < padded_ends[-1]).reshape(-1, step).any(axis=1)

    @jax.checkpoint  # the backward pass gathers a step's kernels again, not keep every step's
    def multiply(_, inputs):
        block, block_groups, used = inputs
        return None, jax.lax.cond(
            used,
            lambda: jnp.einsum("tri,toi->tro", block, kernels[block_groups]),
            # zeros, as a product over no features: typed as the product is (within
            # `shard_map`, varying over the mesh axes its inputs vary over)
            lambda: jnp.einsum("tri,oi->tro", block[..., :0], kernels[0, :, :0]),
        )

    blocks = laid_out.reshape(tiles // step, step, tile, width)
    _, products = jax.lax.scan(multiply, None, (blocks, tile_group.reshape(-1, step), step_used))
    return jnp.where(held[:, None], products.reshape(tiles * tile, -1)[slot], 0)

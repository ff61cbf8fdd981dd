"""Per-step health of an update: global gradient norm, parameter norm, update/parameter ratio.

Computed inside the jitted train step and summed with the other training metrics, so they cost a
few reductions on the device and nothing on the host: a window's means are fetched with its loss.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp


def global_norm(leaves: Sequence[jax.Array]) -> jax.Array:
    """The L2 norm of all the arrays together, in float32."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def update_norms(
    before: Sequence[jax.Array], grads: Sequence[jax.Array], after: Sequence[jax.Array]
) -> dict[str, jax.Array]:
    """`grad_norm`, `param_norm` (of the params the step started from) and `update_ratio`
    (how far the step moved the params, relative to their size: about the learning rate for
    Adam-like optimizers; much larger means the step is too big)."""
    param_norm = global_norm(before)
    moved = global_norm(
        [a.astype(jnp.float32) - b.astype(jnp.float32) for a, b in zip(after, before, strict=True)]
    )
    return {
        "grad_norm": global_norm(grads),
        "param_norm": param_norm,
        "update_ratio": moved / jnp.maximum(param_norm, jnp.finfo(jnp.float32).tiny),
    }

"""The health of an update: global gradient norm, parameter norm, update/parameter ratio.

Sampled every `logging.norms_every` steps: `norms_step` takes the state, batch and key
that the train step is about to use and computes that step's gradients and update on copies,
before it, so the values are exactly those of that step and the train step itself stays as it
is (a dozen extra reductions in every step, and the copy of the params that comparing before
with after forces, would cost several percent of a small model's step; a sample costs about one
gradient computation). The result is fetched with a later log window, so the host never waits
for it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from zoo.engine.steps.functions import Steps


def global_norm(leaves: Sequence[jax.Array]) -> jax.Array:
    """The L2 norm of all the arrays together, in float32."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in leaves))


def update_norms(
    before: Sequence[jax.Array], grads: Sequence[jax.Array], after: Sequence[jax.Array]
) -> dict[str, jax.Array]:
    """`grad_norm`, `param_norm` (of the params the step starts from) and `update_ratio`
    (how far the step moves the params, relative to their norm: about the learning rate for
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


def make_norms_step(graphdef: nnx.GraphDef, steps: Steps) -> Callable:
    """`norms_step(state, batch, key) -> update_norms(...)` of the train step that `state`,
    `batch` and `key` would make, over the params it trains (a fine-tune's frozen params get no
    gradient and do not move); `state` is read, never changed."""
    trained = steps.trainable.params

    @jax.jit
    def norms_step(state, batch: Mapping[str, jax.Array], key: jax.Array):
        _, grads = steps.grad(state, batch, key)
        model, optimizer = nnx.merge(graphdef, state)
        before = jax.tree.leaves(nnx.state(model, trained))
        optimizer.update(model, grads)
        after = jax.tree.leaves(nnx.state(model, trained))
        return update_norms(before, jax.tree.leaves(grads), after)

    return norms_step

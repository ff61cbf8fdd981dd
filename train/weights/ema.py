"""`optimizer.ema_decay`: an exponential moving average of the trained params, kept as the last
link of the optax chain so it lives in the optimizer state: sharded like the params it averages,
checkpointed with them, restored on resume, dropped with them by a skipped NaN step.

Where the run keeps float32 master weights (`zoo.engine.weights.master`), this link sees the masters, so
the average is float32 too: averaging bfloat16 params would round away the small moves that
make the average. The averaged params are read in the params' own dtype.

The average starts at zero and is read debiased (divided by 1 - decay^t, as optax's own
`ema` of updates does), so it is the average of the params this run has produced whatever they
started from (a seed or another run's weights).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from zoo.engine.weights.master import inner_state


class EmaState(NamedTuple):
    count: jax.Array  # updates averaged so far
    average: Any  # biased toward zero: read it with `debiased`


def params_ema(decay: float) -> optax.GradientTransformation:
    """Passes the updates through unchanged, averaging the params they lead to."""

    def init(params):
        return EmaState(jnp.zeros((), jnp.int32), optax.tree.zeros_like(params))

    def update(updates, state, params):
        new_params = optax.apply_updates(params, updates)
        average = optax.incremental_update(new_params, state.average, 1.0 - decay)
        return updates, EmaState(optax.safe_increment(state.count), average)

    return optax.GradientTransformation(init, update)


def averaged(graphdef: nnx.GraphDef, state: Any, wrt: Any, decay: float) -> Any:
    """The train state `(model, optimizer)` with the params `wrt` selects replaced by their
    average (before any update: the params themselves). Call it inside `jax.jit`."""
    model, optimizer = nnx.merge(graphdef, state)
    ema: EmaState = inner_state(optimizer.opt_state)[-1]
    count = ema.count[...]
    average = optax.tree.bias_correction(nnx.to_pure_dict(ema.average), decay, count)
    params = nnx.state(model, wrt)
    current = nnx.to_pure_dict(params)
    nnx.replace_by_pure_dict(
        params,
        jax.tree.map(lambda a, p: jnp.where(count > 0, a, p).astype(p.dtype), average, current),
    )
    nnx.update(model, params)
    return nnx.state((model, optimizer))

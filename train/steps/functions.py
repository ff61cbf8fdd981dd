"""The jitted train and eval steps: pure functions of (state, batch), built once per run.

The model and optimizer are split into a static graphdef and a pytree of state once, outside the
hot loop; each step merges them inside jit (free at run time), so per-step host overhead is
that of a plain `jax.jit` call. The state is donated, so params and optimizer state are updated
in place. Metrics are summed on device across steps and fetched once per log window.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from zoo.engine.pipeline.batches import MASK
from zoo.engine.registry import LOSS_MASK, WEIGHT
from zoo.engine.steps import rngs as zoo_rngs
from zoo.engine.weights.freeze import train_mode

COUNT = "count"
"""The sum of example weights (training: steps) under which the other sums are accumulated."""
NONFINITE = "nonfinite_steps"
"""Training: how many steps of the window had a NaN or Inf loss."""
FIRST_NONFINITE = "first_nonfinite"
"""Training: the position in the window (1-based) of its first step with a NaN or Inf loss; 0:
none. Counters, not means: `means` leaves them out, `health` reads them."""
_COUNTERS = (COUNT, NONFINITE, FIRST_NONFINITE)

Metrics = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class Trainable:
    """What a step trains: the params `params` selects (the rest get no gradient), with the
    BatchNorm layers at `frozen_norms` kept in eval mode (see `zoo.engine.weights.freeze`)."""

    params: nnx.filterlib.Filter = nnx.Param
    frozen_norms: tuple[tuple[Any, ...], ...] = ()
    microbatches: int = 1  # trainer.grad_accum_steps: see `_accumulated`


@dataclasses.dataclass(frozen=True)
class Steps:
    """A run's jitted step functions, all made from one graphdef, loss and `Trainable`: the
    probes' gradients (`grad`) are exactly those that `train` applies."""

    train: Callable
    eval: Callable
    grad: Callable
    trainable: Trainable


def make_steps(
    graphdef: nnx.GraphDef,
    loss_fn: Callable,
    trainable: Trainable = Trainable(),
    skip_nonfinite: bool = False,
) -> Steps:
    return Steps(
        train=make_train_step(graphdef, loss_fn, skip_nonfinite, trainable),
        eval=make_eval_step(graphdef, loss_fn),
        grad=make_grad_step(graphdef, loss_fn, trainable),
        trainable=trainable,
    )


def _loss_and_grads(
    graphdef: nnx.GraphDef, loss_fn: Callable, trainable: Trainable, state, batch, key
):
    """Merge, switch to train mode and differentiate the batch-mean loss with respect to the
    trainable params; the step number comes from the optimizer's own counter, so it never
    crosses from the host."""
    model, optimizer = nnx.merge(graphdef, state)
    train_mode(model, trainable.frozen_norms)
    if trainable.microbatches > 1:
        loss, metrics, grads = _accumulated(model, loss_fn, trainable, batch, key, optimizer.step)
        return model, optimizer, loss, metrics, grads
    rngs = zoo_rngs.call_rngs(key, optimizer.step[...])

    def objective(model, batch, rngs):
        loss, metrics = loss_fn(model, batch, rngs)
        metrics = dict(metrics)
        weight = metrics.pop(WEIGHT, None)
        if weight is None:
            return jnp.mean(loss), {name: jnp.mean(value) for name, value in metrics.items()}
        total = jnp.sum(weight)
        return jnp.sum(loss * weight) / total, {
            name: jnp.sum(value * weight) / total for name, value in metrics.items()
        }

    (loss, metrics), grads = nnx.value_and_grad(
        objective, argnums=nnx.DiffState(0, trainable.params), has_aux=True
    )(model, batch, rngs)
    return model, optimizer, loss, metrics, grads


def _accumulated(model: nnx.Module, loss_fn: Callable, trainable: Trainable, batch, key, step):
    """The batch's (weighted) mean loss, metrics and gradients, computed over
    `trainable.microbatches` equal slices of it in a `lax.scan`: only one slice's activations
    are alive at a time. Sums of loss x weight and of the gradients of that sum are carried
    through the scan and divided by the batch's total weight at the end, so the result is the
    full batch's up to float rounding. Stateful layers see the slices one after another: a
    BatchNorm normalises each slice by its own statistics and updates its running averages once
    per slice. Dropout draws a different key for each slice."""
    n = trainable.microbatches
    graph, params, rest = nnx.split(model, trainable.params, ...)
    slices = jax.tree.map(lambda x: _microbatches(x, n), batch)

    step = step[...]

    def objective(params, rest, micro, slice_key):
        slice_model = nnx.merge(graph, params, rest, copy=True)  # Variables of this trace
        loss, metrics = loss_fn(slice_model, micro, zoo_rngs.call_rngs(slice_key, step))
        metrics = dict(metrics)
        weight = metrics.pop(WEIGHT, jnp.ones_like(loss))
        sums = {name: jnp.sum(value * weight) for name, value in {"loss": loss, **metrics}.items()}
        sums[WEIGHT] = jnp.sum(weight)
        return sums["loss"], (sums, nnx.split(slice_model, trainable.params, ...)[2])

    def body(carry, inputs):
        rest, grad_sums, sums = carry
        micro, index = inputs
        (_, (micro_sums, rest)), grads = jax.value_and_grad(objective, has_aux=True)(
            params, rest, micro, jax.random.fold_in(key, index)
        )
        return (rest, jax.tree.map(jnp.add, grad_sums, grads), _add(sums, micro_sums)), None

    first = jax.eval_shape(lambda: objective(params, rest, _first(slices), key)[1][0])
    zeros = {name: jnp.zeros(s.shape, jnp.float32) for name, s in first.items()}
    # Summed in float32 whatever the params' dtype: bfloat16 sums of slices would round.
    grad_zeros = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.promote_types(p.dtype, "f4")), params)
    (rest, grad_sums, sums), _ = jax.lax.scan(
        body, (rest, grad_zeros, zeros), (slices, jnp.arange(n))
    )
    nnx.update(model, rest)
    total = sums.pop(WEIGHT)
    grads = jax.tree.map(lambda g: (g / total).astype(g.dtype), grad_sums)
    mean = {name: value / total for name, value in sums.items()}
    return mean.pop("loss"), mean, grads


def _first(slices):
    return jax.tree.map(lambda x: x[0], slices)


def _microbatches(x: jax.Array, n: int) -> jax.Array:
    """`x` (batch x ...) as n slices (n x batch/n x ...), slice i holding rows i, i+n, ...:
    each device's rows stay on it, spread evenly over the slices, so no slice moves data."""
    spec = jax.typeof(x).sharding.spec
    rows = jnp.reshape(x, (x.shape[0] // n, n, *x.shape[1:]), out_sharding=P(spec[0], None))
    return jnp.moveaxis(rows, 1, 0)


def make_train_step(
    graphdef: nnx.GraphDef,
    loss_fn: Callable,
    skip_nonfinite: bool = False,
    trainable: Trainable = Trainable(),
) -> Callable:
    """`train_step(state, sums, batch, key) -> (state, sums)`, where `sums` accumulates each
    step's mean loss and metrics (and `count` the steps) until the caller fetches them.

    A step whose loss is NaN or Inf is counted in `sums` (see `NONFINITE`); with
    `skip_nonfinite` its update is dropped: the whole state (params, optimizer, BatchNorm
    statistics, RNG counts) comes out as it went in."""

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, sums: Metrics, batch: Mapping[str, jax.Array], key: jax.Array):
        # Read before merging: the merged modules update the same Variables in place.
        specs = jax.tree.map(lambda x: jax.typeof(x).sharding.spec, state)
        before = jax.tree.leaves(state)
        model, optimizer, loss, metrics, grads = _loss_and_grads(
            graphdef, loss_fn, trainable, state, batch, key
        )
        optimizer.update(model, grads)
        finite = jnp.isfinite(loss)
        new_state = _resharded(nnx.state((model, optimizer)), specs)
        if skip_nonfinite:
            after, treedef = jax.tree.flatten(new_state)
            new_state = jax.tree.unflatten(
                treedef, [jnp.where(finite, a, b) for a, b in zip(after, before, strict=True)]
            )
        step_metrics = {
            "loss": loss,
            **metrics,
            COUNT: jnp.ones((), jnp.float32),
            NONFINITE: (~finite).astype(jnp.float32),
        }
        new_sums = _add(sums, step_metrics)
        first = sums.get(FIRST_NONFINITE, jnp.zeros((), jnp.float32))
        new_sums[FIRST_NONFINITE] = jnp.where(
            (first == 0) & ~finite, new_sums[COUNT], first
        ).astype(jnp.float32)
        return new_state, new_sums

    def metric_names(state, sums, batch: Mapping[str, jax.Array], key: jax.Array) -> list[str]:
        """The names of the sums `train_step` returns, from a trace of the loss alone: every
        sum is a float32 scalar, so the names are all `zero_metrics` needs. A trace of the
        whole step (its backward pass and update too) for them was a second one in every run:
        the step's first call, given the zero sums in place of `{}`, traces it again."""

        def names(state, batch, key):
            model, optimizer = nnx.merge(graphdef, state)
            train_mode(model, trainable.frozen_norms)
            _, metrics = loss_fn(model, batch, zoo_rngs.call_rngs(key, optimizer.step[...]))
            return {name: jnp.zeros(()) for name in metrics if name != WEIGHT}

        measured = jax.eval_shape(names, state, batch, key)
        return ["loss", *measured, COUNT, NONFINITE, FIRST_NONFINITE]

    train_step.metric_names = metric_names
    return train_step


def make_grad_step(
    graphdef: nnx.GraphDef, loss_fn: Callable, trainable: Trainable = Trainable()
) -> Callable:
    """`grad_step(state, batch, key) -> (loss, grads)`: what `train_step` would apply, without
    applying it (for checking that every mesh computes the same step)."""

    @jax.jit
    def grad_step(state, batch: Mapping[str, jax.Array], key: jax.Array):
        _, _, loss, _, grads = _loss_and_grads(graphdef, loss_fn, trainable, state, batch, key)
        return loss, grads

    return grad_step


def make_eval_step(graphdef: nnx.GraphDef, loss_fn: Callable) -> Callable:
    """`eval_step(state, sums, batch, key) -> sums`: per-example metrics summed under the
    batch's mask, so padding rows count for nothing and every real example counts once (or
    with the weight the loss function gives it, see `zoo.engine.registry.WEIGHT`). A padding
    row's `LOSS_MASK` is zeroed too, so that a metric over the whole batch (`loss_tokens`)
    counts the real rows' targets alone."""

    @jax.jit
    def eval_step(state, sums: Metrics, batch: Mapping[str, jax.Array], key: jax.Array):
        model, _ = nnx.merge(graphdef, state)
        model.eval()
        inputs = {name: value for name, value in batch.items() if name != MASK}
        if LOSS_MASK in inputs:
            trained = inputs[LOSS_MASK]
            real = batch[MASK].reshape(-1, *(1,) * (trained.ndim - 1)) > 0
            inputs[LOSS_MASK] = jnp.where(real, trained, jnp.zeros_like(trained))
        loss, metrics = loss_fn(model, inputs, zoo_rngs.call_rngs(key, 0))
        metrics = dict(metrics)
        weight = batch[MASK] * metrics.pop(WEIGHT, 1.0)
        # A padding row counts for nothing, even where its loss is NaN (a preference loss of a
        # pair with no reply's tokens).
        batch_sums = {
            name: jnp.sum(jnp.where(weight > 0, value * weight, 0.0))
            for name, value in {"loss": loss, **metrics}.items()
        }
        return _add(sums, {**batch_sums, COUNT: jnp.sum(weight)})

    return eval_step


def _resharded(state, specs):
    """Give every leaf of the new state the sharding it came in with. A value computed in the
    step may come out sharded differently (BatchNorm statistics follow their activations'
    sharding): the state's layout must stay fixed, or donation fails and the step compiles
    again."""
    return jax.tree.map(jax.sharding.reshard, state, specs)


def zero_metrics(step_fn: Callable, *args: Any) -> Metrics:
    """Zeros shaped like the metric sums that `step_fn(*args)` returns last (a train step of
    `make_train_step` says their names itself, see its `metric_names`)."""
    names = getattr(step_fn, "metric_names", None)
    if names is not None:
        return {name: jnp.zeros((), jnp.float32) for name in names(*args)}
    shapes = jax.eval_shape(step_fn, *args)
    sums = shapes[-1] if isinstance(shapes, tuple) else shapes
    return {name: jnp.zeros(s.shape, s.dtype) for name, s in sums.items()}


def means(sums: Mapping[str, Any]) -> dict[str, float]:
    """Host-side means of fetched sums (a blocking fetch: call it on finished windows only)."""
    host = jax.device_get(dict(sums))
    count = float(host[COUNT])
    return {name: float(value) / count for name, value in host.items() if name not in _COUNTERS}


def health(sums: Mapping[str, Any]) -> tuple[int, int]:
    """(steps with a NaN/Inf loss, 1-based position of the first in the window; 0: none)."""
    if NONFINITE not in sums:
        return 0, 0
    host = jax.device_get({k: sums[k] for k in (NONFINITE, FIRST_NONFINITE)})
    return int(host[NONFINITE]), int(host[FIRST_NONFINITE])


def _add(sums: Metrics, values: Metrics) -> Metrics:
    if not sums:
        return {name: value.astype(jnp.float32) for name, value in values.items()}
    return {name: sums[name] + values[name].astype(jnp.float32) for name in values}

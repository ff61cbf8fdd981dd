"""Histograms of every param and its gradient, computed on the device.

Every `logging.histogram_every` steps the loop runs `histogram_step` on the state and batch that
the train step is about to use, before that step: the gradients are those the step applies, the
params those it starts from. Only small summaries leave the device (min, max, sum, sum of
squares, count and bucket counts per array), and they are fetched with the next log window, so
the host never waits for them. The step reads the state without donating or changing it, so a
run's bits are the same with histograms on or off.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from zoo.engine.steps.functions import Steps

BUCKETS = 30

Summary = dict[str, jax.Array]
"""`min`, `max`, `num`, `sum`, `sum_squares`, `bucket_limits`, `bucket_counts` of one array."""


def summarize(values: jax.Array, buckets: int = BUCKETS) -> Summary:
    """A histogram of `values` over `buckets` equal buckets between their min and max."""
    flat = jax.sharding.reshard(values, P()).astype(jnp.float32).reshape(-1)
    low, high = jnp.min(flat), jnp.max(flat)
    width = jnp.maximum(high - low, jnp.finfo(jnp.float32).tiny) / buckets
    index = jnp.clip(jnp.floor((flat - low) / width).astype(jnp.int32), 0, buckets - 1)
    return {
        "min": low,
        "max": high,
        "num": jnp.asarray(flat.size, jnp.float32),
        "sum": jnp.sum(flat),
        "sum_squares": jnp.sum(jnp.square(flat)),
        "bucket_limits": low + width * jnp.arange(1, buckets + 1, dtype=jnp.float32),
        "bucket_counts": jnp.bincount(index, length=buckets).astype(jnp.float32),
    }


GROUP = "weights"
"""The tag group of the histograms. TensorBoard's Time Series orders groups by name and opens
the first two: `weights` sorts after `train` and `val`, so the curves come first."""


def tag(path: tuple, grad: bool = False) -> str:
    """`weights/hidden/0/kernel` for a param, `weights/hidden/0/kernel/grad` for its gradient:
    the two cards side by side. (A param is a leaf, so `<param>/grad` is never another
    param's path.)"""
    return "/".join([GROUP, *map(str, path), *(["grad"] if grad else [])])


def make_histogram_step(graphdef: nnx.GraphDef, steps: Steps) -> Callable:
    """`histogram_step(state, batch, key) -> {tag: Summary}`: every param, and the gradient of
    each that the run trains, tagged as `tag` says."""

    @jax.jit
    def histogram_step(state, batch: Mapping[str, jax.Array], key: jax.Array):
        _, grads = steps.grad(state, batch, key)
        model, _ = nnx.merge(graphdef, state)
        summaries = {}
        for grad, tree in ((False, nnx.state(model, nnx.Param)), (True, grads)):
            for path, variable in nnx.to_flat_state(tree):
                summaries[tag(path, grad)] = summarize(variable[...])
        return summaries

    return histogram_step

"""A mixture of experts in place of a layer's MLP (Qwen3-MoE, Mixtral): a router scores every
expert for each token, the token goes to the `experts_per_token` likeliest, and its output is
their gated MLPs' outputs weighted by the router's probabilities.

The experts compute dropless: each token reaches every expert it chose, and no expert computes a
token it was not chosen for. The (token, expert) pairs are sorted by expert, and each of the
three projections is one grouped matrix product over them (`jax.lax.ragged_dot_general`: the
rows of expert e multiply expert e's matrix), not a loop over the experts nor a dense product
of every token with every expert. On a mesh each device routes the tokens of its batch rows to
whole experts (`shard_map`); with `tensor` > 1 each device holds a slice of every expert's
hidden features, and the partial outputs are summed over `tensor`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from zoo.plugin import logical_spec, partitioned

_RAGGED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)
"""rows [M, in] x experts' kernels [E, out, in] -> [M, out], the rows of each group multiplying
their expert's kernel (held (out, in), as the checkpoints hold it)."""


@dataclasses.dataclass(frozen=True)
class ExpertOptions:
    """The experts of a mixture layer and how tokens are routed to them."""

    num_experts: int
    experts_per_token: int
    mlp_dim: int  # each expert's hidden width (moe_intermediate_size)
    # Divide a token's chosen experts' probabilities by their sum (Qwen3-MoE's norm_topk_prob;
    # Mixtral always does), rather than keep the softmax's over every expert.
    normalize_weights: bool = True


class Router(nnx.Module):
    """Each token's `experts_per_token` likeliest experts under softmax(x W^T) (computed in
    float32) and their weights, in the dtype of x."""

    def __init__(self, dim: int, options: ExpertOptions, *, dtype, rngs: nnx.Rngs):
        init = partitioned(nnx.initializers.normal(0.02), (None, "embed"))
        self.kernel = nnx.Param(init(rngs.params(), (options.num_experts, dim), dtype))
        self.top_k, self.normalize = options.experts_per_token, options.normalize_weights

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [N, dim] -> (weights [N, k], experts [N, k] int32)."""
        logits = x @ self.kernel[...].T
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probs, self.top_k)
        if self.normalize:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights.astype(x.dtype), experts.astype(jnp.int32)


class Experts(nnx.Module):
    """`num_experts` gated MLPs, down(act(gate(x)) * up(x)), their kernels stacked on a leading
    expert axis, each (out, in) as the checkpoints hold it."""

    def __init__(self, dim: int, options: ExpertOptions, activation, *, dtype, rngs: nnx.Rngs):
        count, hidden = options.num_experts, options.mlp_dim
        init = nnx.initializers.normal(0.02)
        inward = partitioned(init, ("expert", "mlp", "embed"))
        self.gate = nnx.Param(inward(rngs.params(), (count, hidden, dim), dtype))
        self.up = nnx.Param(inward(rngs.params(), (count, hidden, dim), dtype))
        outward = partitioned(init, ("expert", "embed", "mlp"))
        self.down = nnx.Param(outward(rngs.params(), (count, dim, hidden), dtype))
        self.activation = activation


class MixtureOfExperts(nnx.Module):
    """The router and the experts of one layer (`__call__`: [batch, length, dim] in and out)."""

    NOT_ADAPTED = "a mixture of experts (its router and stacked expert kernels)"
    """Why LoRA does not wrap it (`zoo.engine.weights.lora`): no adapters per expert yet."""

    def __init__(self, dim: int, options: ExpertOptions, activation, *, dtype, rngs: nnx.Rngs):
        self.router = Router(dim, options, dtype=dtype, rngs=rngs)
        self.experts = Experts(dim, options, activation, dtype=dtype, rngs=rngs)
        self.num_experts = options.num_experts

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, dim = x.shape
        rows = logical_spec("batch", None)
        tokens = jnp.reshape(x, (batch * length, dim), out_sharding=rows)
        weights, chosen = self.router(tokens)
        hidden = logical_spec("mlp")[0]  # the mesh axes that split each expert's hidden width
        inward, outward = P(None, hidden, None), P(None, None, hidden)
        kernels = (  # gathered from fsdp: each device computes its tokens with whole experts
            jax.sharding.reshard(self.experts.gate[...], inward),
            jax.sharding.reshard(self.experts.up[...], inward),
            jax.sharding.reshard(self.experts.down[...], outward),
        )
        combine = jax.shard_map(
            functools.partial(_combine, self.experts.activation, self.num_experts, hidden),
            in_specs=(rows, rows, rows, inward, inward, outward),
            out_specs=rows,
        )
        routed = (jax.sharding.reshard(a, rows) for a in (tokens, weights, chosen))
        combined = combine(*routed, *kernels)
        return jnp.reshape(combined, x.shape, out_sharding=logical_spec("batch", None, None))


def _combine(activation, count: int, hidden, tokens, weights, chosen, gate, up, down) -> jax.Array:
    """One device's tokens [N, dim]: each one's chosen experts' outputs, weighted and summed.
    The (token, expert) pairs are sorted by expert (stably: within an expert, in token order),
    computed as groups, and added back to their tokens; with the hidden width split over
    `hidden`, each device's partial sums are summed."""
    top_k = chosen.shape[1]
    flat = chosen.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token_of = order // top_k
    sizes = jnp.bincount(flat, length=count).astype(jnp.int32)
    rows = tokens[token_of]
    projected = jax.lax.ragged_dot_general(rows, gate, sizes, _RAGGED)
    middle = activation(projected) * jax.lax.ragged_dot_general(rows, up, sizes, _RAGGED)
    outputs = jax.lax.ragged_dot_general(middle, down, sizes, _RAGGED)
    if hidden is not None:
        outputs = jax.lax.psum(outputs, hidden)
    outputs = outputs * weights.reshape(-1)[order][:, None]
    return jnp.zeros_like(tokens).at[token_of].add(outputs)

"""A mixture of experts in place of a layer's MLP (Qwen3-MoE, Mixtral, gpt-oss, DeepSeek V3): a
router scores every expert for each token, the token goes to the `experts_per_token` likeliest,
and its output is their gated MLPs' outputs weighted by the router's probabilities (DeepSeek V3
adds a shared MLP that every token goes through).

The experts compute dropless: each token reaches every expert it chose, and no expert computes a
token it was not chosen for. The (token, expert) pairs are sorted by expert, and each of the
three projections is one grouped matrix product over them (`zoo.models.grouped_matmul`: the
rows of expert e multiply expert e's matrix, in tiles of one expert each), not a loop over the
experts nor a dense product of every token with every expert. On a mesh each device routes the tokens of its batch rows to
whole experts (`shard_map`); with `tensor` > 1 each device holds a slice of every expert's
hidden features, and the partial outputs are summed over `tensor`. With `expert` > 1 (expert
parallelism) each device holds 1/expert of the experts, whole: the devices of one expert group
gather their tokens and routing, each computes the (token, expert) pairs of its own experts,
and the partial outputs are summed back onto the devices that hold the tokens
(`psum_scatter`), still dropless.

Training adds the router's load-balancing loss (Switch Transformer's, as transformers'
`load_balancing_loss_func` computes it for Qwen3-MoE and Mixtral) times `aux_loss_weight`
(`router_aux_loss_coef`) to the model's loss: `routed_call` keeps each mixture layer's routing
during one forward pass, `load_balancing` turns it into the loss and each layer's load.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from zoo.models.grouped_matmul import grouped_matmul

from zoo.plugin import logical_spec, partitioned


@dataclasses.dataclass(frozen=True)
class ExpertOptions:
    """The experts of a mixture layer and how tokens are routed to them."""

    num_experts: int
    experts_per_token: int
    mlp_dim: int  # each expert's hidden width (moe_intermediate_size)
    # Divide a token's chosen experts' probabilities by their sum (Qwen3-MoE's norm_topk_prob;
    # Mixtral always does), rather than keep the softmax's over every expert.
    normalize_weights: bool = True
    # The weight of the router's load-balancing loss in the training loss
    # (router_aux_loss_coef); 0: none.
    aux_loss_weight: float = 0.0
    router_bias: bool = False  # a bias on the router's logits (gpt-oss)
    # The weights: `all`, the softmax over every expert's logit (Qwen3-MoE, Mixtral); `chosen`,
    # the softmax over the chosen experts' logits alone, picked by logit (gpt-oss); `sigmoid`,
    # each chosen expert's sigmoid score, picked by score plus a correction bias (DeepSeek V3).
    router_softmax: str = "all"
    bias: bool = False  # biases on each expert's gate, up and down projections (gpt-oss)
    # `sigmoid` routing: groups of experts, and how many of them a token's experts come from.
    groups: int = 1
    groups_kept: int = 1
    weight_scale: float = 1.0  # every routed expert's weight multiplied by it
    shared_mlp_dim: int = 0  # a gated MLP every token goes through beside the experts; 0: none


PROJECTIONS = ("gate", "up", "down")
"""An expert's kernels, each stacked over the experts: [experts, out, in]."""
ROUTER_SOFTMAX = ("all", "chosen", "sigmoid")


class Router(nnx.Module):
    """Each token's `experts_per_token` likeliest experts under softmax(x W^T + b) (computed in
    float32; the bias b with `router_bias`) and their weights, in the dtype of x: the chosen
    experts' probabilities (divided by their sum with `normalize_weights`), or with
    `router_softmax=chosen` the softmax over the chosen experts' logits alone (gpt-oss's
    `GptOssTopKRouter`: top-k of the logits first), or with `router_softmax=sigmoid` DeepSeek
    V3's (`_sigmoid_routing`). Every weight times `weight_scale`."""

    def __init__(self, dim: int, options: ExpertOptions, *, dtype, rngs: nnx.Rngs):
        init = partitioned(nnx.initializers.normal(0.02), (None, "embed"))
        self.kernel = nnx.Param(init(rngs.params(), (options.num_experts, dim), dtype))
        zeros = partitioned(nnx.initializers.zeros_init(), (None,))
        self.bias = (
            nnx.Param(zeros(rngs.params(), (options.num_experts,), dtype))
            if options.router_bias
            else None
        )
        # A statistic of the experts' load, not a weight: no gradient reaches it, and no
        # optimizer (AdamW's decay included) moves it; the hub's checkpoints hold it as a buffer.
        self.correction_bias = (
            nnx.BatchStat(zeros(rngs.params(), (options.num_experts,), dtype))
            if options.router_softmax == "sigmoid"
            else None
        )
        self.top_k, self.normalize = options.experts_per_token, options.normalize_weights
        self.over_chosen = options.router_softmax == "chosen"
        self.groups, self.groups_kept = options.groups, options.groups_kept
        self.weight_scale = options.weight_scale

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [N, dim] -> (weights [N, k], experts [N, k] int32, probabilities [N, E] float32)."""
        dtype, kernel = x.dtype, self.kernel[...]
        if self.correction_bias is not None:  # DeepSeek V3 weighs in float32 from the start
            dtype, x, kernel = jnp.float32, x.astype(jnp.float32), kernel.astype(jnp.float32)
        logits = x @ kernel.T
        if self.bias is not None:
            logits = logits + self.bias[...]
        logits = logits.astype(jnp.float32)
        if self.correction_bias is not None:
            weights, experts, probs = self._sigmoid_routing(logits)
        else:
            weights, experts, probs = self._softmax_routing(logits)
        if self.weight_scale != 1.0:
            weights = weights * self.weight_scale
        return weights.astype(dtype), experts.astype(jnp.int32), probs

    def _softmax_routing(self, logits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        probs = jax.nn.softmax(logits, axis=-1)
        if self.over_chosen:
            chosen, experts = jax.lax.top_k(logits, self.top_k)
            weights = jax.nn.softmax(chosen, axis=-1)
        else:
            weights, experts = jax.lax.top_k(probs, self.top_k)
        if self.normalize and not self.over_chosen:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights, experts, probs

    def _sigmoid_routing(self, logits: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """DeepSeek V3's routing (transformers' `DeepseekV3TopkRouter`): each expert scores the
        sigmoid of its logit; the experts are chosen by score plus the correction bias, which
        balances their load without weighing them (so it takes no gradient), among the
        `groups_kept` groups whose two best biased scores sum highest; the weights are the
        chosen scores, divided by their sum (+1e-20) with `normalize`."""
        scores = jax.nn.sigmoid(logits)
        bias = self.correction_bias[...].astype(jnp.float32)
        choice = scores + bias
        if self.groups > 1:
            choice = jnp.where(self._kept_groups(choice), choice, -jnp.inf)
        _, experts = jax.lax.top_k(choice, self.top_k)
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        if self.normalize:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return weights, experts, scores

    def _kept_groups(self, choice: jax.Array) -> jax.Array:
        """Which experts [N, E] lie in the token's `groups_kept` best groups."""
        tokens, count = choice.shape
        grouped = choice.reshape(tokens, self.groups, count // self.groups)
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
        _, kept = jax.lax.top_k(group_scores, self.groups_kept)
        in_kept = jnp.any(kept[:, :, None] == jnp.arange(self.groups)[None, None, :], axis=1)
        return jnp.repeat(in_kept, count // self.groups, axis=-1)


class Routing(nnx.Intermediate):
    """A mixture layer's routing in one forward pass, (probabilities [N, E], chosen experts
    [N, k]), sown only while `routed_call` asks for it."""


class Experts(nnx.Module):
    """`num_experts` gated MLPs, down(gated(gate(x), up(x))) (`gated`: act(gate) * up, or
    gpt-oss's clamped SwiGLU), their kernels stacked on a leading expert axis, each (out, in) as
    the checkpoints hold it; with `bias`, each projection's bias stacked the same way
    (`gate_bias`, `up_bias` [experts, hidden], `down_bias` [experts, dim])."""

    def __init__(self, dim: int, options: ExpertOptions, gated, *, dtype, rngs: nnx.Rngs):
        count, hidden = options.num_experts, options.mlp_dim
        init = nnx.initializers.normal(0.02)
        inward = partitioned(init, ("expert", "mlp", "embed"))
        self.gate = nnx.Param(inward(rngs.params(), (count, hidden, dim), dtype))
        self.up = nnx.Param(inward(rngs.params(), (count, hidden, dim), dtype))
        outward = partitioned(init, ("expert", "embed", "mlp"))
        self.down = nnx.Param(outward(rngs.params(), (count, dim, hidden), dtype))
        if options.bias:
            widths = {"gate": (hidden, "mlp"), "up": (hidden, "mlp"), "down": (dim, "embed")}
            for name, (width, axis) in widths.items():
                zeros = partitioned(nnx.initializers.zeros_init(), ("expert", axis))
                bias = nnx.Param(zeros(rngs.params(), (count, width), dtype))
                setattr(self, f"{name}_bias", bias)
        self.gated = gated

    KERNELS = PROJECTIONS
    """The kernels LoRA adapts (QLoRA holds them quantized in their params' place, each read
    with `[...]`, dequantized, where `projections` reads it)."""

    @property
    def adapted(self) -> bool:
        """Whether the experts hold LoRA adapters (`add_lora`)."""
        return hasattr(self, f"{PROJECTIONS[0]}_lora_a")

    def add_lora(self, rank: int, rngs: nnx.Rngs) -> None:
        """LoRA adapters per expert, stacked as the kernels are (`zoo.engine.weights.lora`'s
        self-adapting modules): for each projection an `A` [experts, rank, in] and a `B`
        [experts, out, rank], float32, sharded along the kernel's axes, `B` zero, so that
        expert e's kernel acts as kernel[e] + B[e] A[e] and the adapted model starts as the
        model. The kernels keep their paths (a checkpoint fills them as before)."""
        for name in PROJECTIONS:
            kernel = getattr(self, name)
            count, out, inputs = kernel.shape
            _, out_axis, in_axis = kernel.get_metadata()["out_sharding"]
            a = partitioned(
                nnx.initializers.he_uniform(in_axis=-1, out_axis=-2, batch_axis=(0,)),
                ("expert", None, in_axis),
            )
            b = partitioned(nnx.initializers.zeros_init(), ("expert", out_axis, None))
            setattr(
                self,
                f"{name}_lora_a",
                nnx.LoRAParam(a(rngs.params(), (count, rank, inputs), jnp.float32)),
            )
            setattr(
                self,
                f"{name}_lora_b",
                nnx.LoRAParam(b(rngs.params(), (count, out, rank), jnp.float32)),
            )

    def merge_lora(self) -> None:
        """Fold each adapter into its kernel (kernel[e] + B[e] A[e], in the kernel's dtype) and
        drop it: the module is then as it was built."""
        if not self.adapted:
            return
        for name in PROJECTIONS:
            kernel = getattr(self, name)
            a, b = (getattr(self, f"{name}_lora_{part}") for part in "ab")
            delta = jnp.einsum(
                "eor,eri->eoi", b[...], a[...], out_sharding=jax.typeof(kernel[...]).sharding.spec
            )
            kernel[...] = kernel[...] + delta.astype(kernel.dtype)
            delattr(self, f"{name}_lora_a")
            delattr(self, f"{name}_lora_b")

    def projections(self, split: Any, hidden: Any) -> dict[str, tuple[jax.Array, ...]]:
        """Each projection's kernel, and its adapter's `A` and `B` where adapted, gathered as a
        device computes with whole experts: the experts split over the mesh axes `split`, each
        expert's hidden width over the mesh axes `hidden`."""
        wanted = {"gate": (hidden, None), "up": (hidden, None), "down": (None, hidden)}
        found = {}
        for name, (out_axis, in_axis) in wanted.items():
            kernel = getattr(self, name)[...]
            arrays = [jax.sharding.reshard(kernel, P(split, out_axis, in_axis))]
            if self.adapted:
                a, b = (getattr(self, f"{name}_lora_{part}")[...] for part in "ab")
                arrays.append(jax.sharding.reshard(a, P(split, None, in_axis)))
                arrays.append(jax.sharding.reshard(b, P(split, out_axis, None)))
            found[name] = tuple(arrays)
        return found

    def biases(self, split: Any, hidden: Any) -> dict[str, jax.Array]:
        """Each projection's biases where the experts have them ({} otherwise), gathered as
        `projections` gathers the kernels: the gate's and up's split over `hidden` as their
        outputs are, the down projection's whole (it is added once the partial outputs are
        summed)."""
        if not hasattr(self, "down_bias"):
            return {}
        wanted = {"gate": P(split, hidden), "up": P(split, hidden), "down": P(split, None)}
        return {
            name: jax.sharding.reshard(getattr(self, f"{name}_bias")[...], spec)
            for name, spec in wanted.items()
        }


class MixtureOfExperts(nnx.Module):
    """The router and the experts of one layer (`__call__`: [batch, length, dim] in and out),
    and the `shared` MLP every token goes through besides, where there is one (DeepSeek V3's
    shared experts), its output added to the experts'."""

    def __init__(
        self,
        dim: int,
        options: ExpertOptions,
        gated,
        *,
        dtype,
        rngs: nnx.Rngs,
        shared: nnx.Module | None = None,
    ):
        self.router = Router(dim, options, dtype=dtype, rngs=rngs)
        self.experts = Experts(dim, options, gated, dtype=dtype, rngs=rngs)
        self.shared = shared
        self.aux_loss_weight = options.aux_loss_weight
        self.recording = False  # `routed_call`

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, dim = x.shape
        rows = logical_spec("batch", None)
        tokens = jnp.reshape(x, (batch * length, dim), out_sharding=rows)
        weights, chosen, probs = self.router(tokens)
        if self.recording:
            self.sow(Routing, "routing", (probs, chosen))
        hidden = logical_spec("mlp")[0]  # the mesh axes that split each expert's hidden width
        split = _expert_split(rows)
        projections = self.experts.projections(split.experts, hidden)  # gathered from fsdp
        biases = self.experts.biases(split.experts, hidden)
        specs = jax.tree.map(lambda a: jax.typeof(a).sharding.spec, (projections, biases))
        combine = jax.shard_map(
            functools.partial(_combine, self.experts.gated, hidden, split),
            in_specs=(rows, rows, rows, *specs),
            out_specs=rows,
        )
        routed = (jax.sharding.reshard(a, rows) for a in (tokens, weights, chosen))
        combined = combine(*routed, projections, biases)
        out = jnp.reshape(combined, x.shape, out_sharding=logical_spec("batch", None, None))
        return out if self.shared is None else out + self.shared(x)


@dataclasses.dataclass(frozen=True)
class ExpertSplit:
    """How the experts of a mixture layer are split over the mesh (expert parallelism):
    `experts`, the mesh axes of more than one device that split them (None: every device holds
    every expert); `gathered`, those of them that also split the tokens (the batch rule names
    them), whose devices gather each other's tokens and scatter the outputs back; `summed`, the
    others, whose devices hold the same tokens and sum their partial outputs."""

    experts: tuple[str, ...] | None
    gathered: tuple[str, ...]
    summed: tuple[str, ...]


def _expert_split(rows: P) -> ExpertSplit:
    """The `ExpertSplit` of the active rules and mesh for tokens laid out as `rows`."""
    sizes = jax.sharding.get_abstract_mesh().shape
    axes = logical_spec("expert")[0]
    named = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    experts = tuple(axis for axis in named if sizes[axis] > 1)
    token_axes = rows[0] if isinstance(rows[0], tuple) else (rows[0],)
    return ExpertSplit(
        experts or None,
        tuple(axis for axis in token_axes if axis in experts),
        tuple(axis for axis in experts if axis not in token_axes),
    )


def _local_experts(
    chosen: jax.Array, count: int, split: ExpertSplit
) -> tuple[jax.Array, jax.Array]:
    """Of the (token, expert) pairs of `chosen` [N, k], flattened: each one's expert among the
    `count` this device holds (`count` for another device's), and whether this device holds
    it."""
    flat = chosen.reshape(-1)
    first = 0 if split.experts is None else jax.lax.axis_index(split.experts) * count
    mine = (flat >= first) & (flat < first + count)
    return jnp.where(mine, flat - first, count), mine


def _combine(gated, hidden, split: ExpertSplit, tokens, weights, chosen, projections, biases):
    """One device's tokens [N, dim]: each one's chosen experts' outputs, weighted and summed.
    The (token, expert) pairs are sorted by expert (stably: within an expert, in token order),
    computed as groups, and added back to their tokens; with the hidden width split over
    `hidden`, each device's partial sums are summed (an adapter's too: its product is linear
    in the split width), and the down projection's bias, where there is one, added after.

    With the experts split over devices (`split`), a device computes the pairs of the tokens
    of its expert group whose experts it holds: the pairs of other devices' experts are sorted
    last, past every group's rows, where the grouped product gives zeros and skips their tiles
    (the arrays are sized for every pair, as dropless routing needs whatever the routing; the
    work is this device's pairs); the outputs go back to their tokens' devices summed. Without
    a split every pair is this device's: the computation is the unsplit one, bit for bit."""
    if split.gathered:
        tokens, weights, chosen = (
            jax.lax.all_gather(a, split.gathered, tiled=True) for a in (tokens, weights, chosen)
        )
    top_k = chosen.shape[1]
    count = projections["gate"][0].shape[0]  # the experts this device holds
    local, mine = _local_experts(chosen, count, split)
    order = jnp.argsort(local, stable=True)
    token_of, expert_of = order // top_k, jnp.minimum(local[order], count - 1)
    sizes = jnp.bincount(local, length=count).astype(jnp.int32)  # other devices' pairs: none

    def project(x: jax.Array, name: str) -> jax.Array:
        kernel, *adapter = projections[name]
        y = grouped_matmul(x, kernel, sizes)
        if adapter:
            a, b = adapter
            y = y + grouped_matmul(grouped_matmul(x, a, sizes), b, sizes).astype(y.dtype)
        return y

    def biased(y: jax.Array, name: str) -> jax.Array:
        return y + biases[name][expert_of] if biases else y

    rows = tokens[token_of]
    middle = gated(biased(project(rows, "gate"), "gate"), biased(project(rows, "up"), "up"))
    outputs = project(middle, "down")
    if hidden is not None:
        outputs = jax.lax.psum(outputs, hidden)
    weight = jnp.where(mine, weights.reshape(-1), 0)[order]
    weighted = biased(outputs, "down") * weight[:, None]  # summed in the weights' dtype
    combined = jnp.zeros(tokens.shape, weighted.dtype).at[token_of].add(weighted)
    if split.gathered:
        combined = jax.lax.psum_scatter(combined, split.gathered, tiled=True)
    combined = jax.lax.psum(combined, split.summed) if split.summed else combined
    return combined.astype(tokens.dtype)


@dataclasses.dataclass
class Recorded:
    """What `routed_call` kept: each mixture layer's (probabilities, chosen experts), in
    the order the model holds the layers, under the layer's path in the model
    (`layers.3.mlp`), and the load-balancing loss's weight."""

    layers: dict[str, tuple[jax.Array, jax.Array]]
    aux_loss_weight: float

    def loss_and_metrics(self, real: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(the weighted load-balancing loss to add to the training loss, what TensorBoard
        shows of the routing) over the tokens of which `real` [batch, length] marks those that
        count: `router_aux_loss` (unweighted), and per layer `expert_load/PATH`, its busiest
        expert's tokens over the mean expert's (1: even; num_experts / experts_per_token: every
        token to the same experts)."""
        rows = jnp.reshape(real, (-1,), out_sharding=logical_spec("batch"))
        loss, load = load_balancing(list(self.layers.values()), rows)
        metrics = {"router_aux_loss": loss}
        for name, tokens in zip(self.layers, load):
            metrics[f"expert_load/{name}"] = jnp.max(tokens) / jnp.maximum(jnp.mean(tokens), 1e-9)
        return self.aux_loss_weight * loss, metrics


def mixture_layers(model: nnx.Module) -> dict[str, MixtureOfExperts]:
    """The mixture layers of `model` by their path in it (`layers.3.mlp`), in its order."""
    return {
        ".".join(map(str, path)): module
        for path, module in nnx.iter_modules(model)
        if isinstance(module, MixtureOfExperts)
    }


def routed_call(model: nnx.Module, call: Callable[[nnx.Module], Any]) -> tuple[Any, Recorded]:
    """`call(model)`, and the routing of every mixture layer of `model` in it (none for a
    model without experts): the layers sow it as `Routing` while `nnx.capture` collects it,
    and only then, so that other calls (generation) keep the model's state as it is."""
    mixtures = mixture_layers(model)
    if not mixtures:
        return call(model), Recorded({}, 0.0)
    for mixture in mixtures.values():
        mixture.recording = True
    try:
        out, captured = nnx.capture(call, Routing)(model)
    finally:
        for mixture in mixtures.values():
            mixture.recording = False
    sown = {
        ".".join(map(str, path[:-1])): variable.get_value()[0]
        for path, variable in nnx.to_flat_state(captured)
    }
    layers = {name: sown[name] for name in mixtures if name in sown}
    return out, Recorded(layers, next(iter(mixtures.values())).aux_loss_weight)


def load_balancing(
    layers: Sequence[tuple[jax.Array, jax.Array]], real: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(the load-balancing loss, each layer's tokens per expert [layers, E]) of the routing of
    `layers` over tokens of which `real` [N] marks those that count (not padding).

    The loss is transformers' `load_balancing_loss_func`: over every layer's real tokens
    together, the share of them routed to each expert (per rank of the top-k) times the mean
    router probability of each expert, summed and multiplied by the number of experts:
    `experts_per_token` for a perfectly even routing. Only the probabilities carry a gradient."""
    real = real.astype(jnp.float32)
    count = layers[0][0].shape[-1]
    total = jnp.maximum(jnp.sum(real) * len(layers), 1.0)
    # [k, E] per layer; the one-hot is fused into the sum, never held
    picks = [jnp.sum(jax.nn.one_hot(c, count) * real[:, None, None], 0) for _, c in layers]
    share = sum(picks) / total
    mean_prob = sum(jnp.sum(p * real[:, None], 0) for p, _ in layers) / total  # [E]
    loss = count * jnp.sum(share * mean_prob[None, :])
    return loss, jax.lax.stop_gradient(jnp.stack([jnp.sum(p, 0) for p in picks]))

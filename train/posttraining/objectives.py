"""What the trainer minimises for a post-training method: the loss function of a batch, as a
model's own loss is (`zoo.engine.registry.LossFn`), made from the run's `finetune` section.

`finetune.method=dpo` trains on preference pairs: each example's `tokens` hold two sequences,
the prompt with the chosen reply and the prompt with the rejected one (`[batch, 2, length + 1]`,
as `data=preference` makes them), with their `length`s and the `loss_mask` of the replies'
tokens; packed pairs (`data.packing=true`) hold several pairs per example, the chosen
sequences of pairs 1, 2, ... as the segments 1, 2, ... of its first row, their rejected ones as
the same segments of its second, with the `segment_ids`, `positions` and `pair_slots` columns
(`zoo.engine.registry.PAIR_SLOTS`): the loss is each pair's, the example's its pairs' mean,
weighted by their number. Both sequences of every pair go through the model in one call (as
`2 x batch` rows);
the reference model's log-probabilities, where the loss needs them, come from the same weights
with the LoRA adapters off (their params set to zero in a copy of the model's graph, which
holds no second copy of the weights): an adapter then adds exactly zero, so the reference is
the starting checkpoint bit for bit, and no gradient flows through it. A model that adds a
loss of its own to any loss (a mixture of experts' router loss, `zoo.engine.registry.
AuxiliaryLoss`) adds it to these too, over the policy's call: every real token of both
sequences of each pair, or of each prompt and completion.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
from zoo.engine.errors import ZooError
from zoo.engine.posttraining.checks import options_from
from zoo.engine.posttraining.policy_gradient import GRPOOptions, grpo_loss
from zoo.engine.posttraining.preference import (
    ADAPTERS,
    COPY,
    ORPO,
    PRECOMPUTED,
    Metrics,
    PreferenceOptions,
    SequenceLogps,
    preference_loss,
    sequence_logps,
)
from zoo.engine.posttraining.rollouts import ADVANTAGES, COMPLETION_MASK, LOGGED, OLD_LOGPS, ROW
from zoo.engine.registry import (
    LOSS_MASK,
    PAIR_SLOTS,
    POSITIONS,
    SEGMENT_IDS,
    WEIGHT,
    AuxiliaryLoss,
    loss_contract,
    real_inputs,
)

SFT, DPO, GRPO = "sft", "dpo", "grpo"
PAIR = 2
"""The sequences of a preference example: the chosen one (index 0), then the rejected one."""
PAIR_COLUMNS = ("tokens", "length", LOSS_MASK)
REFERENCE_LOGPS = "reference_logps"
"""The column of the reference model's log-probabilities where the trainer gives them (a
preference pair's replies' [B, 2]; a sampled sequence's next tokens' [N, T]), with
`reference=precomputed` (`zoo.engine.posttraining.reference`) or `copy` (the trainer computes
it for each batch with a frozen copy of the starting weights: `reference_logps`)."""
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
LOGPS = ("logps/chosen", "logps/rejected")
ORPO_METRICS = ("nll_loss", "log_odds_ratio", "log_odds_chosen")


def method_of(finetune: Any) -> str:
    """`finetune.method` as text (the config holds an enum); `sft` in the config of a run
    saved before there were methods."""
    method = finetune.get("method") or SFT
    return str(getattr(method, "value", method))


def preference_options(finetune: Any) -> PreferenceOptions:
    """The `finetune.dpo` section as checked options; a bad value is refused by its key."""
    return options_from(PreferenceOptions, finetune.dpo, "finetune.dpo.")


def grpo_options(finetune: Any) -> GRPOOptions:
    """The `finetune.grpo` section as checked options; a bad value is refused by its key."""
    return options_from(GRPOOptions, finetune.grpo, "finetune.grpo.")


def training_objective(finetune: Any, model_loss: Callable) -> Callable:
    """The loss the run trains and evaluates with: the model's own for `sft`, the preference
    loss of `finetune.dpo` for `dpo`, the clipped policy-ratio loss of `finetune.grpo` over
    sampled completions for `grpo`."""
    method = method_of(finetune)
    if method == SFT:
        return model_loss
    if method == GRPO:
        return policy_objective(grpo_options(finetune))
    return preference_objective(preference_options(finetune))


def reference_source(finetune: Any) -> str | None:
    """Where the run's reference log-probabilities come from, when the trainer gives them to
    the loss as a column (`precomputed`, `copy`); None: no reference, or the loss's own
    (`adapters`)."""
    method = method_of(finetune)
    if method == GRPO:
        options = grpo_options(finetune)
        return COPY if options.beta and options.reference == COPY else None
    if method != DPO:
        return None
    options = preference_options(finetune)
    if options.uses_reference and options.reference in (PRECOMPUTED, COPY):
        return options.reference
    return None


def reference_logps(finetune: Any) -> Callable[[Any, Mapping[str, jax.Array]], jax.Array]:
    """What the frozen reference model computes of a batch for the loss's `REFERENCE_LOGPS`
    column: each pair's replies' log-probabilities (`dpo`), or each sampled sequence's next
    tokens' (`grpo`)."""
    return sampled_logps if method_of(finetune) == GRPO else pair_logps


def reference_placeholder(finetune: Any, batch: Mapping[str, Any]) -> dict[str, Any]:
    """`batch` with a `REFERENCE_LOGPS` column of zeros of the shape the reference gives it,
    for reading the step's metrics and shapes before there is a reference model."""
    if reference_source(finetune) is None:
        return dict(batch)
    rows, width = batch["tokens"].shape[:2]
    if method_of(finetune) == GRPO:
        shape = (rows, width - 1)
    else:  # packed pairs: a value per slot
        slots = (np.shape(batch[PAIR_SLOTS])[1],) if PAIR_SLOTS in batch else ()
        shape = (rows, PAIR, *slots)
    return {**batch, REFERENCE_LOGPS: np.zeros(shape, np.float32)}


def check_method(finetune: Any, batch: Mapping[str, Any]) -> None:
    """Refuse data whose batches are not what the method trains on, before a model is built:
    pairs for `dpo`, and no pairs for `sft` (a model's own loss reads sequences)."""
    method = method_of(finetune)
    tokens = batch.get("tokens")
    pairs = tokens is not None and tokens.ndim == 3 and tokens.shape[1] == PAIR
    prompts = ROW in batch
    if method == GRPO and not prompts:
        raise ZooError(
            "finetune.method=grpo samples completions of prompts and rewards them: it reads "
            "prompts with the columns reward functions read (their 'row'), as data=prompts "
            f"makes them; this data's batches have {sorted(batch)}. Use data=prompts."
        )
    if method != GRPO and prompts:
        raise ZooError(
            f"This data holds prompts for reward fine-tuning, which finetune.method={method} "
            "cannot train on: set finetune.method=grpo (with finetune.grpo.rewards)."
        )
    if method == GRPO:
        return
    if method == DPO and not pairs:
        raise ZooError(
            "finetune.method=dpo trains on preference pairs: batches whose 'tokens' hold a "
            f"prompt with its chosen and with its rejected reply ([batch, {PAIR}, length]), as "
            "data=preference makes them; this data's batches have "
            + (f"'tokens' of shape {list(tokens.shape)}." if tokens is not None else "none.")
            + " Use data=preference, or finetune.method=sft for conversations (data=chat)."
        )
    if method == SFT and pairs:
        raise ZooError(
            "This data holds preference pairs (a chosen and a rejected reply per prompt), which "
            "finetune.method=sft cannot train on: set finetune.method=dpo."
        )


def shown_examples(finetune: Any, batch: Mapping[str, Any]) -> Mapping[str, Any]:
    """The examples of `batch` that a model's eval hook is shown (it continues the first): the
    chosen sequences of pairs, the batch itself otherwise."""
    if method_of(finetune) != DPO:
        return batch
    return {name: batch[name][:, 0] for name in PAIR_COLUMNS if name in batch}


def preference_objective(options: PreferenceOptions) -> Callable:
    """Per example: the preference loss of `options` and TRL's metrics (`preference_loss`) of
    its pair, or of a packed row's pairs their mean, weighted by their number (`WEIGHT`), so
    that the trainer's means are means over pairs whether or not they are packed."""
    metrics = (*REWARDS, *LOGPS, *(ORPO_METRICS if options.loss_type == ORPO else ()))

    @loss_contract(columns=PAIR_COLUMNS, metrics=metrics)
    def loss(model: Any, batch: Mapping[str, jax.Array], rngs: nnx.Rngs):
        rows, packed = _as_rows(batch["tokens"].astype(jnp.int32)), _packed_rows(batch)
        masks = _pair_masks(batch)
        length = _as_rows(batch["length"])
        policy, term, routed = _policy(model, rows, length, rngs, packed)
        policy = _as_pairs(policy)
        chosen, rejected = (masks.reply_logps(policy, i) for i in range(PAIR))
        reference = None
        if options.uses_reference and options.reference != ADAPTERS:  # given as a column
            given = batch[REFERENCE_LOGPS]
            given = given if PAIR_SLOTS in batch else given[..., None]
            reference = (given[:, 0], given[:, 1])
        elif options.uses_reference:
            base = token_logps(adapters_off(model), rows, rngs, packed)
            base = _as_pairs(jax.lax.stop_gradient(base))
            reference = tuple(masks.reply_logps(base, i).total for i in range(PAIR))
        whole = None
        if options.loss_type == ORPO:  # the chosen sequences' prompts and replies
            whole = sequence_logps(policy[:, 0, None], masks.sequences[:, 0])
        losses, values = preference_loss(
            options, chosen, rejected, reference=reference, chosen_sequence=whole
        )
        losses, values = masks.per_example(losses, values, packed=PAIR_SLOTS in batch)
        return _with_term(losses, values, term, routed)

    return loss


def pair_logps(model: Any, batch: Mapping[str, jax.Array]) -> jax.Array:
    """Each pair's replies' log-probabilities [B, 2] (chosen, rejected), or for packed pairs
    each slot's [B, 2, slots], as `model` scores them in eval mode: what
    `reference=precomputed` computes once with the starting model."""
    rows, masks = _as_rows(batch["tokens"].astype(jnp.int32)), _pair_masks(batch)
    logps = _as_pairs(token_logps(model, rows, nnx.Rngs(0), _packed_rows(batch)))
    totals = jnp.stack([masks.reply_logps(logps, i).total for i in range(PAIR)], 1)
    return totals if PAIR_SLOTS in batch else totals[..., 0]


def sampled_logps(model: Any, batch: Mapping[str, jax.Array]) -> jax.Array:
    """Each sampled sequence's next tokens' log-probabilities [N, T] as `model` scores them in
    eval mode: the sampling policy's (`old_logps`) or the frozen reference's."""
    return token_logps(model, batch["tokens"].astype(jnp.int32), nnx.Rngs(0))


class PairMasks(NamedTuple):
    """Which targets of a batch of pairs [B, 2, T] belong to each pair slot of its rows: one
    slot per row, or a packed row's segments (`PAIR_SLOTS`)."""

    replies: jax.Array  # [B, 2, S, T]: the targets that are slot s's replies' tokens
    sequences: jax.Array  # [B, 2, S, T]: all the real targets of slot s's sequences
    present: jax.Array  # [B, S]: whether slot s holds a pair
    real: jax.Array  # [B, 2, T]: the real targets (not padding)

    def reply_logps(self, logps: jax.Array, side: int) -> SequenceLogps:
        """Each slot's reply on `side` (0: chosen, 1: rejected) as `logps` [B, 2, T] score it;
        an empty slot's log-probability is -1, so that every loss of it is finite (and left
        out by `per_example`) and no NaN reaches a gradient."""
        scored = sequence_logps(logps[:, side, None], self.replies[:, side])
        return scored._replace(total=jnp.where(self.present, scored.total, -1.0))

    def per_example(
        self, losses: jax.Array, metrics: Metrics, packed: bool
    ) -> tuple[jax.Array, Metrics]:
        """The per-slot values [B, S] as per-example ones [B]: a row's one pair's, or the mean
        over a packed row's pairs, weighted by their number, with `packing_efficiency`, the
        share of the batch's targets that are real (not padding)."""
        if not packed:
            return losses[:, 0], {name: value[:, 0] for name, value in metrics.items()}
        count = jnp.sum(self.present, -1).astype(losses.dtype)

        def mean(value: jax.Array) -> jax.Array:
            return jnp.sum(jnp.where(self.present, value, 0.0), -1) / jnp.maximum(count, 1.0)

        per_example = {name: mean(value) for name, value in metrics.items()}
        per_example["packing_efficiency"] = jnp.zeros_like(count) + jnp.mean(self.real)
        return mean(losses), {**per_example, WEIGHT: count}


def _pair_masks(batch: Mapping[str, jax.Array]) -> PairMasks:
    """The `PairMasks` of a batch of pairs: unpacked, one slot per row, which holds a pair
    where its chosen reply has a token (an eval batch's padding rows have none)."""
    real = jnp.arange(batch["tokens"].shape[-1] - 1) < batch["length"][..., None]
    replies = real & (batch[LOSS_MASK] > 0)
    if PAIR_SLOTS not in batch:
        present = jnp.any(replies[:, 0], axis=-1, keepdims=True)
        whole = (real & present[:, :, None])[:, :, None]
        return PairMasks(replies[:, :, None], whole, present, real)
    present = batch[PAIR_SLOTS] > 0
    slots = jnp.arange(1, present.shape[-1] + 1)
    in_slot = _target_segments(batch[SEGMENT_IDS], real)[:, :, None] == slots[:, None]
    return PairMasks(in_slot & replies[:, :, None], in_slot, present, real)


def _target_segments(segment_ids: jax.Array, real: jax.Array) -> jax.Array:
    """The segment of each real next-token target of packed rows [..., T] (0: none): its input
    token's, where the token it predicts is of the same segment (a segment's last token does
    not predict the next one's first). A row's last target predicts a token outside the
    column, which is of the last input's segment (every segment holds at least two tokens)."""
    following = jnp.concatenate([segment_ids[..., 1:], segment_ids[..., -1:]], axis=-1)
    return jnp.where(real & (segment_ids == following), segment_ids, 0)


def _packed_rows(batch: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """The columns that keep packed pairs' sequences apart in the model, as rows [2B, T]."""
    return {name: _as_rows(batch[name]) for name in (SEGMENT_IDS, POSITIONS) if name in batch}


def policy_objective(options: GRPOOptions) -> Callable:
    """Per completion: GRPO's loss (`grpo_loss`) of a batch that `Rollouts` made, with the
    policy's entropy over the completion's tokens and what the batch carries to report."""
    metrics = ("entropy", "clip_ratio/low", "clip_ratio/high", "clip_ratio/region")
    metrics += ("kl",) if options.beta else ()

    @loss_contract(columns=("tokens", "length", COMPLETION_MASK, ADVANTAGES), metrics=metrics)
    def loss(model: Any, batch: Mapping[str, jax.Array], rngs: nnx.Rngs):
        rows = batch["tokens"].astype(jnp.int32)
        real = jnp.arange(rows.shape[1] - 1) < batch["length"][:, None]
        mask = real & (batch[COMPLETION_MASK] > 0)
        (logps, entropy), term, routed = _policy(model, rows, batch["length"], rngs, entropy=True)
        reference = None
        if options.beta and options.reference == COPY:  # given as a column
            reference = batch[REFERENCE_LOGPS]
        elif options.beta:
            reference = jax.lax.stop_gradient(token_logps(adapters_off(model), rows, rngs))
        losses, metrics = grpo_loss(
            options,
            logps,
            mask,
            batch[ADVANTAGES],
            old_token_logps=batch.get(OLD_LOGPS),
            ref_token_logps=reference,
        )
        counted = mask.astype(entropy.dtype)
        metrics["entropy"] = jax.lax.stop_gradient(
            jnp.sum(entropy * counted, -1) / jnp.maximum(jnp.sum(counted, -1), 1.0)
        )
        logged = {name[len(LOGGED) :]: batch[name] for name in batch if name.startswith(LOGGED)}
        return _with_term(losses, {**metrics, **logged}, term, routed)

    return loss


def _policy(
    model: Any,
    rows: jax.Array,
    length: jax.Array,
    rngs: nnx.Rngs,
    packed: Mapping[str, jax.Array] | None = None,
    entropy: bool = False,
) -> tuple[Any, jax.Array, dict[str, jax.Array]]:
    """(`token_logps` of the policy, the loss term the model adds of its own, what it reports
    of it) over every real input token of `rows` (`length` real targets each; a packed row's
    segments): a term of 0 and nothing for a model that adds none."""

    def scores(m: Any) -> Any:
        return token_logps(m, rows, rngs, packed, entropy)

    if not isinstance(model, AuxiliaryLoss):
        return scores(model), jnp.zeros((), jnp.float32), {}
    segments = (packed or {}).get(SEGMENT_IDS)
    return model.with_auxiliary_loss(scores, real_inputs(length, rows.shape[1] - 1, segments))


def _with_term(
    losses: jax.Array, metrics: dict[str, jax.Array], term: jax.Array, routed: dict
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Each example's loss with the batch's `term` added (so the batch's mean adds it once),
    and the term's metrics, the same for every example."""
    shown = {name: jnp.zeros_like(losses) + value for name, value in routed.items()}
    return losses + term, {**metrics, **shown}


def token_logps(
    model: Any,
    rows: jax.Array,
    rngs: nnx.Rngs,
    packed: Mapping[str, jax.Array] | None = None,
    entropy: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The model's log-probability of each next token of `rows` [N, T + 1]: [N, T], in
    float32 (a one-hot contraction, as the language models' loss takes it, which shards over
    the vocabulary); `packed`: packed rows' `SEGMENT_IDS` and `POSITIONS` [N, T]; with
    `entropy`, also the entropy of each next-token distribution [N, T] (reported, not
    trained)."""
    logits = model(rows[:, :-1], rngs=rngs, **(packed or {}))
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    one_hot = jax.nn.one_hot(rows[:, 1:], log_probs.shape[-1], dtype=log_probs.dtype)
    chosen = jnp.sum(one_hot * log_probs, axis=-1)
    if not entropy:
        return chosen
    probs = jnp.exp(log_probs)  # a masked padded row: exp(-1e30) = 0, 0 * -1e30 = 0
    return chosen, jax.lax.stop_gradient(-jnp.sum(probs * log_probs, axis=-1))


def adapters_off(model: nnx.Module) -> nnx.Module:
    """The reference: a copy of `model`'s graph whose LoRA adapters are zero, in eval mode
    (no Dropout), sharing every other array with `model` (what it computes is not to be
    differentiated: the caller stops the gradient)."""
    graph, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
    base = nnx.merge(graph, jax.tree.map(jnp.zeros_like, adapters), rest, copy=True)
    base.eval()
    return base


def _as_rows(pairs: jax.Array) -> jax.Array:
    """[B, 2, ...] -> [2B, ...], each pair's rows next to each other (on its device)."""
    return jnp.reshape(
        pairs, (-1, *pairs.shape[2:]), out_sharding=P(_lead(pairs), *(None,) * (pairs.ndim - 2))
    )


def _as_pairs(rows: jax.Array) -> jax.Array:
    """[2B, ...] -> [B, 2, ...]: `_as_rows` undone."""
    shape = (rows.shape[0] // PAIR, PAIR, *rows.shape[1:])
    return jnp.reshape(rows, shape, out_sharding=P(_lead(rows), *(None,) * (rows.ndim)))


def _lead(x: jax.Array) -> Any:
    """The mesh axes the leading (batch) dimension of `x` is split over."""
    spec = jax.typeof(x).sharding.spec
    return spec[0] if len(spec) else None

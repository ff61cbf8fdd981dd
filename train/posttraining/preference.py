"""The losses of preference fine-tuning: each example is a prompt with a chosen and a rejected
reply, which the policy (and, for the DPO family, the reference model) scores as each reply's
log-probability, its tokens' log-probabilities summed.

`preference_loss` returns per-pair losses and metrics (the log-probabilities' shape: [B], or
[B, slots] for packed rows), which the trainer averages over the batch's pairs
(`zoo.engine.registry.LossFn`); the batch's mean of each equals what TRL 1.16's trainers compute
and log for the same log-probabilities (their own code run on fixed inputs by
tests/fixtures/posttraining/make_losses.py):

- against a reference (TRL's `DPOTrainer`): `sigmoid` (DPO), `ipo`, `hinge` and `robust`;
- reference-free: `simpo` (TRL's `CPOTrainer`, `loss_type="simpo"`, `cpo_alpha=0`) and `orpo`
  (TRL's `ORPOTrainer`).

The metrics are those TRL logs: `rewards/chosen` and `rewards/rejected` (the implicit rewards,
beta times the log-ratio to the reference, or for the reference-free methods beta times the
average log-probability), `rewards/margins` (chosen minus rejected), `rewards/accuracies` (1
where the chosen reward is the higher), `logps/chosen` and `logps/rejected` (the policy's
log-probabilities: summed, or for the reference-free methods averaged over the reply's tokens),
and ORPO's `nll_loss`, `log_odds_ratio` and `log_odds_chosen`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from zoo.engine.errors import ZooError
from zoo.engine.posttraining.checks import choice, number

SIGMOID, IPO, HINGE, ROBUST, SIMPO, ORPO = "sigmoid", "ipo", "hinge", "robust", "simpo", "orpo"
WITH_REFERENCE = (SIGMOID, IPO, HINGE, ROBUST)
"""The methods that compare the policy with a reference model (the DPO family)."""
METHODS = (*WITH_REFERENCE, SIMPO, ORPO)
SMOOTHED = (SIGMOID, ROBUST, SIMPO)
"""The methods that read `label_smoothing`."""
SIMPO_GAMMA = 0.5
"""SimPO's target margin where `gamma` is unset (TRL's default `simpo_gamma`)."""
ADAPTERS, PRECOMPUTED, COPY = "adapters", "precomputed", "copy"
REFERENCES = (ADAPTERS, PRECOMPUTED, COPY)
"""Where a reference model's log-probabilities can come from."""

Metrics = dict[str, jax.Array]


@dataclasses.dataclass
class PreferenceOptions:
    """How a preference loss is computed, checked when made (a `ZooError` naming the option and
    what would be valid); the config's `finetune.dpo` section."""

    # The loss: `sigmoid` (DPO), `ipo`, `hinge`, `robust` (against a reference model), `simpo`
    # or `orpo` (reference-free).
    loss_type: str = SIGMOID
    # The strength of the preference: how far from the reference the policy may go (DPO, IPO's
    # tau, hinge, robust), the scale of SimPO's length-normalised reward, or the weight of
    # ORPO's odds-ratio term (its paper's lambda).
    beta: float = 0.1
    # The probability that a pair's preference is the wrong way round, in [0, 0.5): `sigmoid`
    # and `simpo` take the conservative loss (cDPO), `robust` the unbiased one (rDPO).
    label_smoothing: float = 0.0
    # SimPO's target margin between the chosen and the rejected reply's average log-probability
    # reward (TRL's `simpo_gamma`); unset: 0.5. Refused by the other methods, which have none.
    gamma: float | None = None
    # Where the reference model's log-probabilities come from (sigmoid, ipo, hinge, robust):
    # `adapters`, the starting model with the LoRA adapters off (finetune.lora_rank > 0), at
    # each step: no second copy of the weights, a second forward pass; `precomputed`, the
    # starting model's, computed once over the data before training (again when a run
    # resumes), kept in host memory (8 bytes a pair): no second pass, for any fine-tune;
    # `copy`, a frozen copy of the starting model's weights on the devices, a second forward
    # pass at each step, for any fine-tune. simpo and orpo, which need none, refuse another.
    reference: str = ADAPTERS

    def __post_init__(self) -> None:
        _check(self)

    @property
    def uses_reference(self) -> bool:
        """Whether the method compares the policy with a reference model."""
        return self.loss_type in WITH_REFERENCE


class SequenceLogps(NamedTuple):
    """One side (chosen, rejected) of a batch of pairs as a model scores it."""

    total: jax.Array  # [B, ...] each reply's log-probability: its tokens' log-probabilities summed
    tokens: jax.Array  # [B, ...] each reply's number of tokens


def sequence_logps(token_logps: jax.Array, mask: jax.Array) -> SequenceLogps:
    """The log-probability and the length of each sequence from its next-token log-probabilities
    [B, T] and a mask [B, T] of the tokens that count (1: a reply's token). What the other
    positions hold (-inf too) reaches neither the sum nor its gradient."""
    counts = mask.astype(bool)
    total = jnp.sum(jnp.where(counts, token_logps, 0.0), -1)
    return SequenceLogps(total, jnp.sum(counts, -1).astype(token_logps.dtype))


def preference_loss(
    options: PreferenceOptions,
    chosen: SequenceLogps,
    rejected: SequenceLogps,
    *,
    reference: tuple[jax.Array, jax.Array] | None = None,
    chosen_sequence: SequenceLogps | None = None,
) -> tuple[jax.Array, Metrics]:
    """Per-pair losses and metrics of the policy's `chosen` and `rejected` replies.

    `reference`: the reference model's log-probabilities (summed) of the chosen and of the
    rejected replies, which the methods of `WITH_REFERENCE` need. `chosen_sequence`: the
    policy's log-probability of each whole chosen sequence, the tokens its NLL term trains, which
    `orpo` needs (TRL trains the prompt's tokens and the reply's).
    """
    if options.uses_reference:
        if reference is None:
            raise ZooError(
                f"loss_type={options.loss_type} compares the policy with a reference model: give the "
                "reference's log-probabilities of the chosen and rejected replies."
            )
        return _against_reference(options, chosen, rejected, *reference)
    if options.loss_type == SIMPO:
        return _simpo(options, chosen, rejected)
    if chosen_sequence is None:
        raise ZooError(
            "loss_type=orpo trains the chosen sequences' likelihood too: give the policy's "
            "log-probabilities of the whole chosen sequences (chosen_sequence)."
        )
    return _orpo(options, chosen, rejected, chosen_sequence)


def _against_reference(
    options: PreferenceOptions,
    chosen: SequenceLogps,
    rejected: SequenceLogps,
    ref_chosen: jax.Array,
    ref_rejected: jax.Array,
) -> tuple[jax.Array, Metrics]:
    """The DPO family: a function of the difference between the chosen and the rejected
    reply's log-ratio to the reference."""
    beta, smoothing = options.beta, options.label_smoothing
    chosen_ratio, rejected_ratio = chosen.total - ref_chosen, rejected.total - ref_rejected
    delta = chosen_ratio - rejected_ratio
    if options.loss_type == SIGMOID:
        loss = _smoothed_sigmoid(beta * delta, smoothing)
    elif options.loss_type == HINGE:
        loss = jax.nn.relu(1 - beta * delta)
    elif options.loss_type == ROBUST:
        clean = -(1 - smoothing) * jax.nn.log_sigmoid(beta * delta)
        flipped = -smoothing * jax.nn.log_sigmoid(-beta * delta)
        loss = (clean - flipped) / (1 - 2 * smoothing)
    else:  # IPO, over log-ratios averaged over each reply's tokens as TRL takes them
        per_token = chosen_ratio / _count(chosen) - rejected_ratio / _count(rejected)
        loss = (per_token - 1 / (2 * beta)) ** 2
    metrics = _reward_metrics(beta * chosen_ratio, beta * rejected_ratio)
    return loss, {**metrics, "logps/chosen": chosen.total, "logps/rejected": rejected.total}


def _simpo(
    options: PreferenceOptions, chosen: SequenceLogps, rejected: SequenceLogps
) -> tuple[jax.Array, Metrics]:
    """SimPO: the sigmoid loss of the margin between the replies' average log-probabilities,
    less the target margin `gamma / beta`."""
    chosen_mean, rejected_mean = chosen.total / _count(chosen), rejected.total / _count(rejected)
    gamma = SIMPO_GAMMA if options.gamma is None else options.gamma
    margin = chosen_mean - rejected_mean - gamma / options.beta
    loss = _smoothed_sigmoid(options.beta * margin, options.label_smoothing)
    metrics = _reward_metrics(options.beta * chosen_mean, options.beta * rejected_mean)
    return loss, {**metrics, "logps/chosen": chosen_mean, "logps/rejected": rejected_mean}


def _orpo(
    options: PreferenceOptions,
    chosen: SequenceLogps,
    rejected: SequenceLogps,
    chosen_sequence: SequenceLogps,
) -> tuple[jax.Array, Metrics]:
    """ORPO: the chosen sequences' negative log-likelihood, less beta times the log-sigmoid of
    the log odds ratio of the replies' average log-probabilities.

    TRL's NLL term is a mean over all the batch's trained tokens, not over each example's: each
    pair's share of it is its summed NLL times P / (the batch's trained tokens), P the batch's
    pairs (those with a chosen reply: not an eval batch's padding rows, nor a packed row's
    empty slots), so that the batch's mean of the per-pair losses is TRL's loss."""
    chosen_mean, rejected_mean = chosen.total / _count(chosen), rejected.total / _count(rejected)
    log_odds = (chosen_mean - rejected_mean) - (_log1mexp(chosen_mean) - _log1mexp(rejected_mean))
    ratio = jax.nn.log_sigmoid(log_odds)
    pairs = jnp.sum(chosen.tokens > 0).astype(chosen.total.dtype)
    nll = -chosen_sequence.total * pairs / jnp.maximum(jnp.sum(chosen_sequence.tokens), 1.0)
    metrics = _reward_metrics(options.beta * chosen_mean, options.beta * rejected_mean)
    return nll - options.beta * ratio, {
        **metrics,
        "logps/chosen": chosen_mean,
        "logps/rejected": rejected_mean,
        "nll_loss": nll,
        "log_odds_ratio": ratio,
        "log_odds_chosen": log_odds,
    }


def _smoothed_sigmoid(logits: jax.Array, smoothing: float) -> jax.Array:
    """-log sigmoid(logits), the label flipped with probability `smoothing` (cDPO)."""
    return -(1 - smoothing) * jax.nn.log_sigmoid(logits) - smoothing * jax.nn.log_sigmoid(-logits)


def _reward_metrics(chosen: jax.Array, rejected: jax.Array) -> Metrics:
    """The implicit rewards, their margin and whether the chosen reply's is the higher (the
    rewards are watched, not trained: no gradient flows through them)."""
    chosen, rejected = jax.lax.stop_gradient(chosen), jax.lax.stop_gradient(rejected)
    return {
        "rewards/chosen": chosen,
        "rewards/rejected": rejected,
        "rewards/margins": chosen - rejected,
        "rewards/accuracies": (chosen > rejected).astype(chosen.dtype),
    }


def _count(side: SequenceLogps) -> jax.Array:
    """A reply's number of tokens, at least 1 (an empty reply averages to 0, not NaN)."""
    return jnp.maximum(side.tokens, 1.0)


def _log1mexp(x: jax.Array) -> jax.Array:
    """log(1 - exp(x)) for x < 0, accurate on both sides of -log 2 (TRL's branches)."""
    return jnp.where(x < -math.log(2), jnp.log1p(-jnp.exp(x)), jnp.log(-jnp.expm1(x)))


def _check(o: PreferenceOptions) -> None:
    """Refuse a method, strength or smoothing that no preference loss is computed with."""
    choice("loss_type", o.loss_type, METHODS, "a preference loss")
    choice("reference", o.reference, REFERENCES, "a source of the reference model")
    if o.reference != ADAPTERS and o.loss_type not in WITH_REFERENCE:
        raise ZooError(
            f"reference={o.reference} has no effect with loss_type={o.loss_type}, which needs "
            "no reference model: leave reference unset."
        )
    if not (number(o.beta) and o.beta > 0):
        raise ZooError(f"beta={o.beta} must be a positive number (loss_type={o.loss_type}).")
    smoothing = o.label_smoothing
    if not (number(smoothing) and 0 <= smoothing < 0.5):
        raise ZooError(
            f"label_smoothing={smoothing} must be in [0, 0.5): the probability that a pair's "
            "preference is the wrong way round."
        )
    if smoothing and o.loss_type not in SMOOTHED:
        raise ZooError(
            f"label_smoothing={smoothing} has no effect with loss_type={o.loss_type}: only "
            f"{', '.join(SMOOTHED)} smooth their labels; set it to 0."
        )
    if o.gamma is None:
        return
    if o.loss_type != SIMPO:
        raise ZooError(
            f"gamma={o.gamma} has no effect with loss_type={o.loss_type}: only simpo has a target "
            "margin; leave it unset."
        )
    if not (number(o.gamma) and o.gamma >= 0):
        raise ZooError(f"gamma={o.gamma} must be a number >= 0 (SimPO's target margin).")

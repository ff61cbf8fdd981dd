"""The pieces of reward fine-tuning in the GRPO family, as TRL 1.16's `GRPOTrainer` computes
them (its own code run on fixed inputs by tests/fixtures/posttraining/make_losses.py):

- `group_advantages`: each completion's advantage from the rewards of the completions sampled
  for the same prompt (a group of `num_generations`), with the rewards' statistics;
- `grpo_loss`: the clipped policy-ratio loss over the completions' tokens, with an optional KL
  penalty to the reference model, aggregated as `loss_type` says (GRPO, DAPO, Dr. GRPO, BNPO).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from zoo.engine.errors import ZooError
from zoo.engine.posttraining.checks import choice, number
from zoo.engine.posttraining.preference import ADAPTERS, COPY, PRECOMPUTED
from zoo.engine.registry import WEIGHT

GRPO, DAPO, DR_GRPO, BNPO = "grpo", "dapo", "dr_grpo", "bnpo"
LOSS_TYPES = (GRPO, DAPO, DR_GRPO, BNPO)
TOKEN_WEIGHTED = (DAPO, BNPO)
"""The aggregations that average over all the batch's tokens: their per-example losses come
with each example's number of tokens as its weight (`zoo.engine.registry.WEIGHT`)."""
SCALE_REWARDS = ("group", "batch", "none")
ON_ERROR = ("raise", "skip")
STD_EPSILON = 1e-4
"""Added to the rewards' standard deviation before dividing by it, as TRL does."""

Metrics = dict[str, jax.Array]


@dataclasses.dataclass
class GRPOOptions:
    """How rewards become advantages and advantages a loss, checked when made (a `ZooError`
    naming the option and what would be valid). The defaults are TRL's."""

    # How the per-token losses become one per completion: `grpo` (the mean over its tokens),
    # `dapo` and `bnpo` (the mean over all the batch's tokens), `dr_grpo` (the sum over its
    # tokens divided by max_completion_length).
    loss_type: str = DAPO
    # The weight of the KL penalty to the reference model; 0: none (no reference needed).
    beta: float = 0.0
    # Where the KL's reference log-probabilities come from (beta > 0): `adapters`, the starting
    # model with the LoRA adapters off (finetune.lora_rank > 0): no second copy of the weights,
    # a second forward pass at each step; `copy`, a frozen copy of the starting model's weights
    # on the devices, a second forward pass at each step, for any fine-tune. Completions are
    # sampled as the run goes, so there is nothing to compute once before it.
    reference: str = ADAPTERS
    # The policy ratio is clipped to [1 - epsilon, 1 + epsilon_high].
    epsilon: float = 0.2
    # The upper clip (DAPO's clip-higher); null: epsilon.
    epsilon_high: float | None = None
    # Multiply each token's KL by the policy ratio to the old policy (DeepSeek-V3.2's unbiased
    # KL gradient), which changes the KL's gradient even where the ratio is 1.
    use_bias_correction_kl: bool = True
    # The most tokens a completion has: Dr. GRPO's constant normaliser.
    max_completion_length: int = 512
    # Completions sampled per prompt: the size of a group.
    num_generations: int = 8
    # What the rewards' deviations from their group's mean are divided by: `group` (the
    # group's standard deviation), `batch` (the batch's) or `none` (nothing: Dr. GRPO).
    scale_rewards: str = "group"
    # The reward functions: a built-in's name (exact_match, numeric_match, format,
    # length_penalty) or `module:function`, a function importable from the Python path;
    # zoo.finetune(rewards=[...]) takes Python callables as well.
    rewards: list[str] = dataclasses.field(default_factory=list)
    # Each function's weight in a completion's reward (one per function); null: 1 each.
    reward_weights: list[float] | None = None
    # length_penalty: the tokens below max_completion_length over which its punishment grows
    # from 0 to -1.
    length_cache: int = 0
    # A reward function that raises, or returns what is not one finite number (or None) per
    # completion: `raise` stops the run (its last checkpoint kept); `skip` warns and leaves
    # that function's rewards of the batch unscored.
    on_error: str = "raise"
    # How the completions are sampled: softmax(logits / temperature), > 0, ...
    temperature: float = 1.0
    # ... restricted to the likeliest tokens whose probabilities sum to top_p (1: all) ...
    top_p: float = 1.0
    # ... and to the top_k likeliest (0: all).
    top_k: int = 0
    # Updates per batch of completions, each against the log-probabilities of the policy that
    # sampled them (TRL's num_iterations); trainer.checkpoint_every must be a multiple.
    num_iterations: int = 1
    # Train nothing on a completion cut at max_completion_length (DAPO's overlong filtering).
    mask_truncated_completions: bool = False

    def __post_init__(self) -> None:
        _check(self)

    @property
    def upper_epsilon(self) -> float:
        """The upper clip's distance from 1."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def group_advantages(
    options: GRPOOptions, rewards: jax.Array, weights: jax.Array | None = None
) -> tuple[jax.Array, Metrics]:
    """Each completion's advantage [N] from its rewards [N, F] (one column per reward
    function, NaN where a function gave none), and the rewards' statistics.

    The completions come in groups of `num_generations`, one group per prompt. A completion's
    reward is its functions' rewards times `weights` [F] (default 1), summed over those given;
    one that no function rewards is left out of the means and deviations and its advantage is 0.
    The advantage is the reward less its group's mean, divided (`scale_rewards`) by the
    standard deviation (Bessel-corrected) of its group's or of the batch's rewards plus 1e-4.

    The statistics: `reward` and `reward_std` (over the rewarded completions),
    `frac_reward_zero_std` (the share of completions whose deviation is zero: with `group`,
    the share of groups whose rewards are all equal), and `rewards/mean`, `rewards/std` [F]
    (each function's, over the completions it rewarded).
    """
    count, functions = rewards.shape
    size = options.num_generations
    if count % size:
        raise ZooError(
            f"{count} completions do not split into groups of num_generations={size}: give "
            "each prompt's completions together, num_generations of them."
        )
    weights = jnp.ones(functions, rewards.dtype) if weights is None else weights
    unrewarded = jnp.all(jnp.isnan(rewards), axis=1)
    total = jnp.where(unrewarded, jnp.nan, jnp.nansum(rewards * weights, axis=1))
    groups = total.reshape(-1, size)
    mean = jnp.repeat(jnp.nanmean(groups, axis=1), size)
    if options.scale_rewards == "batch":
        std = jnp.broadcast_to(_nanstd(total), total.shape)
    else:
        std = jnp.repeat(_nanstd(groups, axis=1), size)
    advantages = total - mean
    if options.scale_rewards != "none":
        advantages = advantages / (std + STD_EPSILON)
    return jnp.nan_to_num(advantages, nan=0.0), {
        "reward": jnp.nanmean(total),
        "reward_std": _nanstd(total),
        "frac_reward_zero_std": jnp.mean(jnp.isclose(std, 0.0).astype(rewards.dtype)),
        "rewards/mean": jnp.nanmean(rewards, axis=0),
        "rewards/std": _nanstd(rewards, axis=0),
    }


def grpo_loss(
    options: GRPOOptions,
    token_logps: jax.Array,
    mask: jax.Array,
    advantages: jax.Array,
    *,
    old_token_logps: jax.Array | None = None,
    ref_token_logps: jax.Array | None = None,
) -> tuple[jax.Array, Metrics]:
    """Per-completion losses [B] and metrics of the policy's next-token log-probabilities
    [B, T] of its completions' tokens (`mask` [B, T]: 1 for a completion's token).

    `old_token_logps`: the same under the policy that sampled the completions (null: this
    policy, as on the first update after sampling: the ratio is 1 and only its gradient
    counts). `ref_token_logps`: under the reference model, needed when `beta` > 0.

    Each token's loss is -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A), r the ratio of
    the policy's probability to the old policy's and A the completion's advantage, plus beta
    times the k3 estimate of the KL to the reference (exp(q - p) - (q - p) - 1, p the policy's
    and q the reference's log-probability), times r with `use_bias_correction_kl`.

    The metrics, per completion, averaged over its tokens: `kl` (with beta > 0), and the share
    of its tokens whose ratio is clipped where the clip takes the gradient away:
    `clip_ratio/low` (r < 1 - epsilon, A < 0), `clip_ratio/high` (r > 1 + epsilon_high, A > 0)
    and `clip_ratio/region` (either). Averaged over the batch weighted by the completions'
    token counts, they are the figures TRL logs (`kl`, `clip_ratio/low_mean`, ...), which the
    trainer's weighted mean gives for `dapo` and `bnpo`.
    """
    if options.beta and ref_token_logps is None:
        raise ZooError(
            f"beta={options.beta} penalises the KL to the reference model: give the "
            "reference's log-probabilities (ref_token_logps), or set beta=0."
        )
    counts = mask.astype(bool)
    old = jax.lax.stop_gradient(token_logps) if old_token_logps is None else old_token_logps
    per_token, token_metrics = _token_losses(
        options, token_logps, counts, advantages[:, None], old, ref_token_logps
    )
    mask = counts.astype(token_logps.dtype)
    tokens = jnp.sum(mask, -1)
    summed = jnp.sum(per_token * mask, -1)
    loss = summed / (
        options.max_completion_length if options.loss_type == DR_GRPO else _at_least_one(tokens)
    )
    metrics = {
        name: jax.lax.stop_gradient(jnp.sum(value * mask, -1) / _at_least_one(tokens))
        for name, value in token_metrics.items()
    }
    if options.loss_type in TOKEN_WEIGHTED:
        metrics[WEIGHT] = tokens
    return loss, metrics


def _token_losses(
    options: GRPOOptions,
    token_logps: jax.Array,
    counts: jax.Array,
    advantage: jax.Array,
    old_token_logps: jax.Array,
    ref_token_logps: jax.Array | None,
) -> tuple[jax.Array, Metrics]:
    """Each token's loss [B, T] and its metrics (the KL, whether the clip took its gradient).
    Log-ratios are 0 where `counts` is false, so that whatever padding holds (-inf too) neither
    overflows nor reaches the gradient."""
    ratio = jnp.exp(jnp.where(counts, token_logps - old_token_logps, 0.0))
    low, high = 1 - options.epsilon, 1 + options.upper_epsilon
    per_token = -jnp.minimum(ratio * advantage, jnp.clip(ratio, low, high) * advantage)
    metrics = {}
    if options.beta:
        gap = jnp.where(counts, ref_token_logps - token_logps, 0.0)
        kl = jnp.exp(gap) - gap - 1
        if options.use_bias_correction_kl:
            kl = kl * ratio
        per_token = per_token + options.beta * kl
        metrics["kl"] = kl
    clipped_low = (ratio < low) & (advantage < 0)
    clipped_high = (ratio > high) & (advantage > 0)
    metrics["clip_ratio/low"] = clipped_low
    metrics["clip_ratio/high"] = clipped_high
    metrics["clip_ratio/region"] = clipped_low | clipped_high
    return per_token, metrics


def _at_least_one(tokens: jax.Array) -> jax.Array:
    """A completion's number of tokens, at least 1 (an empty one's mean is 0, not NaN)."""
    return jnp.maximum(tokens, 1.0)


def _nanstd(x: jax.Array, axis: int | None = None) -> jax.Array:
    """The Bessel-corrected standard deviation of the values that are not NaN: NaN where fewer
    than two are."""
    count = jnp.sum(~jnp.isnan(x), axis=axis)
    mean = jnp.nanmean(x, axis=axis, keepdims=True)
    variance = jnp.nanmean((x - mean) ** 2, axis=axis)
    return jnp.sqrt(jnp.where(count > 1, variance * count / jnp.maximum(count - 1, 1), jnp.nan))


def _check(o: GRPOOptions) -> None:
    """Refuse an aggregation, a clip, a penalty or a size that no loss is computed with."""
    choice("loss_type", o.loss_type, LOSS_TYPES, "a GRPO loss aggregation")
    choice("scale_rewards", o.scale_rewards, SCALE_REWARDS, "a scaling of the rewards")
    if not number(o.beta) or o.beta < 0:
        raise ZooError(f"beta={o.beta} must be a number >= 0 (0: no KL penalty, no reference).")
    _check_reference(o)
    if not number(o.epsilon) or not 0 <= o.epsilon < 1:
        raise ZooError(
            f"epsilon={o.epsilon} must be in [0, 1): the policy ratio is clipped at 1 - epsilon."
        )
    if o.epsilon_high is not None and (not number(o.epsilon_high) or o.epsilon_high < 0):
        raise ZooError(
            f"epsilon_high={o.epsilon_high} must be a number >= 0 (the ratio's upper clip is "
            "1 + epsilon_high), or null for epsilon."
        )
    if not isinstance(o.use_bias_correction_kl, bool):
        raise ZooError(
            f"use_bias_correction_kl={o.use_bias_correction_kl!r} must be true or false."
        )
    _check_sampling(o)
    for key, value, least, why in (
        ("max_completion_length", o.max_completion_length, 1, "the most tokens a completion has"),
        ("num_generations", o.num_generations, 2, "a group compares its completions"),
        ("num_iterations", o.num_iterations, 1, "updates per batch of completions"),
        ("length_cache", o.length_cache, 0, "length_penalty's ramp, in tokens"),
        ("top_k", o.top_k, 0, "0: every token"),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ZooError(f"{key}={value} must be a whole number >= {least} ({why}).")


def _check_reference(o: GRPOOptions) -> None:
    """A reference the KL penalty can be computed against, and none without one."""
    if o.reference == PRECOMPUTED:
        raise ZooError(
            f"reference={o.reference}: the completions GRPO's KL is taken over are sampled as "
            f"the run goes, so nothing can be computed before it: use {ADAPTERS} (with LoRA) "
            f"or {COPY} (a frozen copy of the starting weights)."
        )
    choice("reference", o.reference, (ADAPTERS, COPY), "a reference model for the KL penalty")
    if not o.beta and o.reference != ADAPTERS:
        raise ZooError(
            f"reference={o.reference} keeps a reference model for the KL penalty, but beta=0 "
            f"has none: set beta > 0, or leave reference={ADAPTERS} (the default)."
        )


def _check_sampling(o: GRPOOptions) -> None:
    """The sampling of completions, and what a bad reward does."""
    choice("on_error", o.on_error, ON_ERROR, "what a bad reward does")
    if not number(o.temperature) or o.temperature <= 0:
        raise ZooError(
            f"temperature={o.temperature} must be a number > 0: a group's completions must "
            "differ for their rewards to teach anything."
        )
    if not number(o.top_p) or not 0 < o.top_p <= 1:
        raise ZooError(f"top_p={o.top_p} must be in (0, 1] (1: every token).")
    if o.length_cache > o.max_completion_length:
        raise ZooError(
            f"length_cache={o.length_cache} must be at most max_completion_length="
            f"{o.max_completion_length}."
        )
    weights = o.reward_weights
    if weights is not None and (
        len(weights) != len(o.rewards) or not all(number(w) for w in weights)
    ):
        raise ZooError(
            f"reward_weights={list(weights)} must be one number per reward function "
            f"(rewards={list(o.rewards)}), or null for 1 each."
        )

"""Post-training beyond imitation: the losses of preference fine-tuning (`preference`: DPO,
IPO, hinge, robust DPO, SimPO, ORPO) and of reward fine-tuning in the GRPO family
(`policy_gradient`: group-normalised advantages, the clipped policy-ratio loss and its
aggregations), as pure functions of log-probabilities, equal to TRL's; the reward functions
that score sampled completions (`rewards`); and what the trainer minimises for each
`finetune.method` (`objectives`)."""

from zoo.engine.posttraining.objectives import (
    DPO,
    SFT,
    check_method,
    method_of,
    pair_logps,
    precomputes_reference,
    preference_options,
    shown_examples,
    training_objective,
)
from zoo.engine.posttraining.policy_gradient import GRPOOptions, group_advantages, grpo_loss
from zoo.engine.posttraining.preference import (
    ADAPTERS,
    PRECOMPUTED,
    PreferenceOptions,
    SequenceLogps,
    preference_loss,
    sequence_logps,
)
from zoo.engine.posttraining.reference import with_reference_logps
from zoo.engine.posttraining.rewards import (
    BUILTIN_REWARDS,
    RewardError,
    RewardFunction,
    exact_match,
    format_match,
    length_penalty,
    numeric_match,
    resolve_reward,
    reward_metrics,
    reward_names,
    score,
)

__all__ = [
    "ADAPTERS",
    "BUILTIN_REWARDS",
    "DPO",
    "PRECOMPUTED",
    "SFT",
    "GRPOOptions",
    "PreferenceOptions",
    "RewardError",
    "RewardFunction",
    "SequenceLogps",
    "check_method",
    "exact_match",
    "format_match",
    "group_advantages",
    "grpo_loss",
    "length_penalty",
    "method_of",
    "numeric_match",
    "pair_logps",
    "precomputes_reference",
    "preference_loss",
    "preference_options",
    "resolve_reward",
    "reward_metrics",
    "reward_names",
    "score",
    "sequence_logps",
    "shown_examples",
    "training_objective",
    "with_reference_logps",
]

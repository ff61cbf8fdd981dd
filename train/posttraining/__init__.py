"""Post-training beyond imitation: the losses of preference fine-tuning (`preference`: DPO,
IPO, hinge, robust DPO, SimPO, ORPO) and of reward fine-tuning in the GRPO family
(`policy_gradient`: group-normalised advantages, the clipped policy-ratio loss and its
aggregations), as pure functions of log-probabilities, equal to TRL's; the reward functions
that score sampled completions (`rewards`); and what the trainer minimises for each
`finetune.method` (`objectives`)."""

from zoo.engine.posttraining.objectives import (
    DPO,
    GRPO,
    REFERENCE_LOGPS,
    SFT,
    check_method,
    grpo_options,
    method_of,
    pair_logps,
    preference_options,
    reference_source,
    shown_examples,
    token_logps,
    training_objective,
)
from zoo.engine.posttraining.policy_gradient import GRPOOptions, group_advantages, grpo_loss
from zoo.engine.posttraining.preference import (
    ADAPTERS,
    COPY,
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
from zoo.engine.posttraining.rollouts import (
    OLD_LOGPS,
    Rollouts,
    Sampled,
    python_name,
    reward_functions,
)

__all__ = [
    "ADAPTERS",
    "BUILTIN_REWARDS",
    "COPY",
    "DPO",
    "GRPO",
    "OLD_LOGPS",
    "PRECOMPUTED",
    "REFERENCE_LOGPS",
    "SFT",
    "GRPOOptions",
    "PreferenceOptions",
    "RewardError",
    "RewardFunction",
    "Rollouts",
    "Sampled",
    "SequenceLogps",
    "check_method",
    "exact_match",
    "format_match",
    "group_advantages",
    "grpo_loss",
    "grpo_options",
    "length_penalty",
    "method_of",
    "numeric_match",
    "pair_logps",
    "preference_loss",
    "preference_options",
    "python_name",
    "reference_source",
    "resolve_reward",
    "reward_functions",
    "reward_metrics",
    "reward_names",
    "score",
    "sequence_logps",
    "shown_examples",
    "token_logps",
    "training_objective",
    "with_reference_logps",
]

"""Post-training beyond imitation: the losses of preference fine-tuning (`preference`: DPO,
IPO, hinge, robust DPO, SimPO, ORPO) and of reward fine-tuning in the GRPO family
(`policy_gradient`: group-normalised advantages, the clipped policy-ratio loss and its
aggregations), as pure functions of log-probabilities, equal to TRL's."""

from zoo.engine.posttraining.policy_gradient import GRPOOptions, group_advantages, grpo_loss
from zoo.engine.posttraining.preference import (
    PreferenceOptions,
    SequenceLogps,
    preference_loss,
    sequence_logps,
)

__all__ = [
    "GRPOOptions",
    "PreferenceOptions",
    "SequenceLogps",
    "group_advantages",
    "grpo_loss",
    "preference_loss",
    "sequence_logps",
]

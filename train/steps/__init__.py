"""What one step computes: the jitted train and eval steps (`functions`), the optimizer and its
schedule (`optim`), the precision a model computes in (`precision`), the random keys each step
derives (`rngs`), and what the step measures besides the loss (`norms`, `histograms`)."""

from zoo.engine.steps.functions import make_eval_step
from zoo.engine.steps.precision import computing
from zoo.engine.steps.rngs import construction_rngs, eval_key

__all__ = [
    "computing",
    "construction_rngs",
    "eval_key",
    "make_eval_step",
]

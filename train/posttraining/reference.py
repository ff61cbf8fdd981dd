"""`finetune.dpo.reference=precomputed`: the reference model's log-probabilities of every
pair's replies, computed once with the starting weights before training, and joined to each
split as the `reference_logps` column, so that a step needs no reference model at all.

The trainer computes them right after building the model from its starting weights, before a
checkpoint is restored: a resumed run computes the same values again (the same program on the
same weights and batches), so nothing more is saved, and it resumes to the same bits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from zoo.engine.errors import ZooError
from zoo.engine.pipeline import MASK, WithColumns, eval_batches
from zoo.engine.posttraining.objectives import REFERENCE_LOGPS
from zoo.engine.registry import Splits

Logps = Callable[[Mapping[str, Any]], jax.Array]
"""A batch of pairs -> each pair's replies' log-probabilities [B, 2] under the reference."""


def with_reference_logps(splits: Splits, batch_size: int, logps: Logps) -> Splits:
    """`splits` with each example's reference log-probabilities joined as a column."""
    if jax.process_count() > 1:
        raise ZooError(
            "finetune.dpo.reference=precomputed computes the reference over the whole data in "
            f"one process; this run has {jax.process_count()}: use "
            "finetune.dpo.reference=adapters (with finetune.lora_rank > 0)."
        )
    return dataclasses.replace(
        splits,
        train=_joined(splits, splits.train, batch_size, logps, "train"),
        eval=_joined(splits, splits.eval, batch_size, logps, "eval"),
    )


def _joined(splits: Splits, data: Any, batch_size: int, logps: Logps, what: str) -> WithColumns:
    """One split with its column of reference log-probabilities, computed in ordered batches
    (the last one's padding rows left out)."""
    values = []
    for batch in eval_batches(data, batch_size, transform=splits.transform):
        real = batch[MASK] > 0
        inputs = {name: value for name, value in batch.items() if name != MASK}
        values.append(np.asarray(jax.device_get(logps(inputs)), np.float32)[real])
    return WithColumns(data, {REFERENCE_LOGPS: np.concatenate(values)}, what)

"""What a run trains: the trainable-param filter, and the BatchNorm layers it leaves frozen.

Frozen params get no gradient (`nnx.DiffState(0, trainable)`) and no optimizer state
(`nnx.Optimizer(..., wrt=trainable)`), so they come out of training bit-unchanged. A BatchNorm
layer whose params are all frozen is frozen as a whole: in training too it normalises with its
running statistics and leaves them alone, so a frozen backbone is a fixed function of its input.
"""

from __future__ import annotations

from typing import Any

from flax import nnx

from train.paths import BACKBONE, matching, outside

Filter = nnx.filterlib.Filter


def frozen_filter(finetune: Any, freeze: Filter | None = None) -> Filter | None:
    """The frozen params: the NNX filter `freeze` if given, else the config's pattern
    (`finetune.freeze`; `backbone` names every param outside `finetune.head`)."""
    if freeze is not None:
        return freeze
    if finetune.freeze is None:
        return None
    if finetune.freeze == BACKBONE:
        return outside(finetune.head)
    return matching(finetune.freeze)


def trainable_filter(finetune: Any, frozen: Filter | None) -> Filter:
    """Every param not frozen; with LoRA adapters, only the adapters and the params that start
    fresh (`finetune.reinit`, e.g. a new head), less any frozen ones."""
    trainable: Filter = nnx.Param
    if finetune.lora_rank:
        trainable = nnx.Any(nnx.LoRAParam, *(matching(p) for p in finetune.reinit))
        trainable = nnx.All(nnx.Param, trainable)
    return trainable if frozen is None else nnx.All(trainable, nnx.Not(frozen))


def frozen_norms(model: nnx.Module, trainable: Filter) -> tuple[tuple[Any, ...], ...]:
    """Paths of the BatchNorm layers none of whose params `trainable` selects."""
    trainable_paths = {path for path, _ in nnx.to_flat_state(nnx.state(model, trainable))}
    frozen = []
    for path, module in nnx.iter_modules(model):
        if not isinstance(module, nnx.BatchNorm):
            continue
        params = [(*path, *p) for p, _ in nnx.to_flat_state(nnx.state(module, nnx.Param))]
        if params and not any(p in trainable_paths for p in params):
            frozen.append(path)
    return tuple(frozen)


def train_mode(model: nnx.Module, frozen: tuple[tuple[Any, ...], ...]) -> None:
    """Training mode, except for the frozen BatchNorm layers, which stay in eval mode."""
    model.train()
    if frozen:
        for path, module in nnx.iter_modules(model):
            if path in frozen:
                module.eval()

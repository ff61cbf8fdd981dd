"""What a run trains: the trainable-param filter, and the BatchNorm layers it leaves frozen.

Frozen params get no gradient (`nnx.DiffState(0, trainable)`) and no optimizer state
(`nnx.Optimizer(..., wrt=trainable)`), so they come out of training bit-unchanged. A BatchNorm
layer whose params are all frozen is frozen as a whole: in training too it normalises with its
running statistics and leaves them alone, so a frozen backbone is a fixed function of its input.
"""

from __future__ import annotations

from typing import Any

from flax import nnx
from zoo.engine.errors import ZooError
from zoo.engine.weights.paths import BACKBONE, dotted, matching, outside

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


def check_frozen(model: nnx.Module, frozen: Filter | None, trainable: Filter, what: str) -> None:
    """Refuse a freeze that names no param (a typo would silently train the whole model) or
    leaves nothing to train; `what` is how the caller named it (e.g. `finetune.freeze='x'`)."""
    if frozen is None:
        return
    params = [dotted(path) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    modules = sorted({path.split(".")[0] for path in params})
    if not nnx.to_flat_state(nnx.state(model, nnx.All(nnx.Param, frozen))):
        raise ZooError(
            f"{what} matches none of the model's params, so nothing would be frozen. Name a "
            f"module or param by its dotted path (or a leading part of it); the model's "
            f"top-level modules: {', '.join(modules)}; or 'backbone' for every param outside "
            "the head."
        )
    if not nnx.to_flat_state(nnx.state(model, trainable)):
        raise ZooError(
            f"{what} freezes every param the run would train ({len(params)} params, in "
            f"{', '.join(modules)}), so nothing would learn. Freeze a part of the model, e.g. "
            "'backbone' (every param outside the head)."
        )


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

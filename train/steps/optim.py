"""The optax optimizer and learning-rate schedule named by the `optimizer` config section."""

from __future__ import annotations

from typing import Any

import jax
import optax
from zoo.engine.config import OptimizerName, ScheduleName
from zoo.engine.weights.ema import params_ema


def learning_rate_schedule(opt: Any, total_steps: int) -> optax.Schedule:
    """Linear warm-up to `learning_rate`, then the named decay to the final fraction."""
    peak, warmup = float(opt.learning_rate), int(opt.warmup_steps)
    schedule = ScheduleName(opt.schedule)
    decay_steps = max(total_steps - warmup, 1)
    end = peak * float(opt.final_lr_fraction)
    if schedule is ScheduleName.constant:
        decay = optax.constant_schedule(peak)
    elif schedule is ScheduleName.cosine:
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=float(opt.final_lr_fraction))
    else:
        decay = optax.linear_schedule(peak, end, decay_steps)
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def make_optimizer(
    opt: Any, total_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    schedule = learning_rate_schedule(opt, total_steps)
    name = OptimizerName(opt.name)
    if name is OptimizerName.sgd:
        tx = optax.sgd(schedule, momentum=float(opt.momentum) or None)
    elif name is OptimizerName.adam:
        tx = optax.adam(schedule)
    else:
        mask = None if opt.decay_all else decay_mask
        tx = optax.adamw(schedule, weight_decay=float(opt.weight_decay), mask=mask)
    if opt.grad_clip_norm is not None:
        tx = optax.chain(optax.clip_by_global_norm(float(opt.grad_clip_norm)), tx)
    if opt.ema_decay is not None:
        tx = optax.chain(tx, params_ema(float(opt.ema_decay)))
    return tx, schedule


DECAYED = ("kernel", "lora_a", "lora_b")
"""The params AdamW decays by default: the weights of Linear and Conv layers and of LoRA
adapters. Biases, norm scales and offsets, embedding tables, position embeddings and class
tokens are left alone: pulling them toward zero only fights what they encode."""


def decay_mask(params: Any) -> Any:
    """True for each param named in `DECAYED` (the last name on its path)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: _name(path) in DECAYED, params)


def _name(path: tuple[Any, ...]) -> str:
    """The last dict key of a pytree path (a State's leaves may add a `.value` after it)."""
    return next((str(k.key) for k in reversed(path) if hasattr(k, "key")), "")

"""What a run says about itself as it opens: to TensorBoard its config, sharding plan, model
summary and HParams; to the console what it trains, where it starts, on which devices (and
whether an NVIDIA GPU is left unused), and its sharding plan."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from omegaconf import DictConfig, OmegaConf
from zoo.engine.report.devices import cpu_build_warning, describe, nvidia_gpu_sign
from zoo.engine.report.reporter import TRAIN, Reporter, val_tag
from zoo.engine.report.summaries import hparams_summaries, model_summary
from zoo.engine.sharding.plan import ShardingPlan

log = logging.getLogger("zoo")


def announce_run(
    reporter: Reporter,
    *,
    cfg: DictConfig,
    saved_config: Mapping[str, Any],
    model: nnx.Module,
    plan: ShardingPlan,
    eval_metrics: Sequence[str],
    start_step: int,
    stopped_early: bool,
    mesh: jax.sharding.Mesh,
    param_count: int,
    workdir: str,
) -> None:
    """Announce the run that starts (or resumes) at `start_step`; `model` is only read."""
    step = start_step
    reporter.text("config", _as_markdown_code(OmegaConf.to_yaml(cfg, resolve=True)), step)
    reporter.text("sharding_plan", _as_markdown_code(plan.table()), step=step)
    reporter.text("model_summary", _as_markdown_code(model_summary(model)), step=step)
    metric_tags = [val_tag(name) for name in eval_metrics]
    reporter.summaries(hparams_summaries(saved_config, [*metric_tags, f"{TRAIN}/loss"]))
    total = int(cfg.trainer.steps)
    log.info(
        "%s %s on %s for %d steps (batch %d) on mesh %s; %s parameters; workdir %s",
        _how(step, total, stopped_early),
        cfg.model.name,
        cfg.data.name,
        total,
        cfg.trainer.batch_size,
        dict(mesh.shape),
        f"{param_count:,}",
        workdir,
    )
    _announce_devices(mesh)
    log.info("%s", plan.table())


def _announce_devices(mesh: jax.sharding.Mesh) -> None:
    """The devices line, and the warning of an NVIDIA GPU left unused."""
    log.info("%s", describe(mesh.devices.flat))
    warning = cpu_build_warning(mesh.devices.flat[0].platform, nvidia_gpu_sign())
    if warning:
        log.warning("%s", warning)


def _how(step: int, total: int, stopped_early: bool) -> str:
    """How the console's first line begins: a fresh start, a resume, or a run already done."""
    if stopped_early:
        return f"Already complete (stopped early at step {step}): training"
    if step:
        return (
            "Already complete: " if step == total else ""
        ) + f"Resuming at step {step}: training"
    return "Training"


def _as_markdown_code(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())

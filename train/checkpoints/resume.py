"""Choosing the checkpoint to resume from, and refusing configs that would change the run.

A resumed run must continue the very run that wrote the checkpoint. So its config may differ only
in keys that decide how long it runs and what it writes on the way (`RESUMABLE`); any other
change (model, data, optimizer, seed, batch size) stops it with the list of changed keys.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf
from zoo.engine.checkpoints.manager import Checkpointer
from zoo.engine.checkpoints.reader import read_json, saved_steps
from zoo.engine.config import resume_step
from zoo.engine.errors import ZooError

RESUMABLE = (
    "trainer.steps",
    "trainer.epochs",  # it decides trainer.steps, no more
    "trainer.log_every",
    "trainer.eval_every",
    "trainer.checkpoint_every",
    "trainer.keep",
    "trainer.best_metric",
    "trainer.best_mode",
    "trainer.resume",
    "trainer.nan_policy",
    "trainer.profile_steps",
    "trainer.debug",  # how the steps run, not what they compute
    "trainer.steps_per_dispatch",  # same bits for every K; the checkpoint's position counts batches
    "logging.",  # what is written to TensorBoard, not what is trained
    "mesh.",  # the state is resharded onto the new mesh as it is restored
    "data.workers",  # the batches and the iterator's position do not depend on it
    "workdir",
)
"""Keys (or prefixes, ending in '.') that a resumed run may change."""


def flatten(node: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in node.items():
        if isinstance(value, Mapping):
            yield from flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def resumable(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUMABLE)


def config_changes(
    saved: Mapping[str, Any], current: Mapping[str, Any]
) -> tuple[list[str], list[str]]:
    """(changes that are refused, changes that are allowed), each as 'key: old -> new'."""
    old, new = dict(flatten(saved)), dict(flatten(current))
    refused, allowed = [], []
    for key in sorted(old.keys() | new.keys()):
        if old.get(key, "<absent>") != new.get(key, "<absent>"):
            change = f"{key}: {old.get(key, '<absent>')} -> {new.get(key, '<absent>')}"
            (allowed if resumable(key) else refused).append(change)
    return refused, [c for c in allowed if not c.startswith(("trainer.resume:", "workdir:"))]


def candidates(checkpointer: Checkpointer, resume: str) -> list[int]:
    """The steps to try, best first, for `trainer.resume`; [] means start fresh."""
    return _candidates(checkpointer.all_steps(), checkpointer.directory, resume)


def _candidates(steps: list[int], where: str, resume: str) -> list[int]:
    steps = sorted(steps)
    if resume == "never":
        if steps:
            raise ZooError(
                f"trainer.resume=never, but {where} already holds checkpoints at steps "
                f"{_listed(steps)}; they are never overwritten. Use another workdir, move them "
                "away, or resume with trainer.resume=auto."
            )
        return []
    wanted = resume_step(resume)
    if wanted is None:  # auto
        return sorted(steps, reverse=True)
    if wanted not in steps:
        raise ZooError(
            f"trainer.resume={wanted}: there is no checkpoint at step {wanted} in {where}; "
            f"saved steps: {_listed(steps) if steps else 'none'}."
        )
    later = [s for s in steps if s > wanted]
    if later:
        raise ZooError(
            f"trainer.resume={wanted}: {where} also holds later checkpoints (steps "
            f"{_listed(later)}) that resuming from step {wanted} would overwrite. Move them "
            "away first, or resume with trainer.resume=auto."
        )
    return [wanted]


def precheck(cfg: DictConfig) -> None:
    """The CLI's early check, before Hydra writes into the workdir: the same refusals as the
    trainer's (`trainer.resume` that cannot apply, a config that changes what is trained),
    from the checkpoints' JSON configs alone. Unreadable checkpoints are left to the trainer."""
    where = os.path.join(os.path.abspath(cfg.workdir), "checkpoints")
    if not os.path.isdir(where):
        return
    current = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    for step in _candidates(saved_steps(where), where, str(cfg.trainer.resume)):
        path = os.path.join(where, str(step))
        try:
            saved = read_json(path, "config")
        except (OSError, ValueError):
            continue
        check_config(step, path, saved, current)
        return


def check_config(
    step: int, path: str, saved: Mapping[str, Any], current: Mapping[str, Any]
) -> list[str]:
    """Refuse a resume whose config changes what is trained; the allowed changes."""
    refused, allowed = config_changes(saved, current)
    warmups = [saved["optimizer"]["warmup_steps"], current["optimizer"]["warmup_steps"]]
    if step >= max(warmups):  # past the warm-up either way: it only reshapes the decay, as a
        # longer trainer.steps does (a model's default warm-up fitted to a short run follows it)
        moved = [c for c in refused if c.startswith("optimizer.warmup_steps:")]
        refused, allowed = [c for c in refused if c not in moved], [*allowed, *moved]
    if refused:
        raise ZooError(
            f"Cannot resume from the checkpoint at step {step} ({path}): the config changes what "
            f"is trained: {'; '.join(refused)}. A resumed run may change only "
            f"{', '.join(k.rstrip('.') + ('.*' if k.endswith('.') else '') for k in RESUMABLE)}, "
            "and optimizer.warmup_steps once past the warm-up. Run with the original values, or "
            "use another workdir to start a new run."
        )
    return allowed


def _listed(steps: list[int]) -> str:
    return ", ".join(map(str, steps))

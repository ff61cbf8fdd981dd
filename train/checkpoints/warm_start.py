"""Starting a model from the checkpoint of another run: finding it, and restoring its weights.

A run's workdir holds `checkpoints/<step>/`, each with the model's state under `state/0` and the
run's resolved config (JSON). `locate` picks one (`latest`, `best`, or a step) and explains what
it looked for when there is none; `read_first` reads it, and for `latest` falls back to the
latest checkpoint that can be read, as a resumed run does (reading never renames or deletes).
`restore_model` fills a model with everything its checkpoint holds for it (loading a trained
model); `warm_start` fills only its params and BatchNorm statistics (a fine-tune's start: RNG
streams start fresh), leaves the params that `reinit` names as initialised, and refuses a
checkpoint whose shapes differ anywhere else, naming each param.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from zoo.engine.checkpoints.failures import quiet_storage_noise, reason
from zoo.engine.checkpoints.reader import (
    SavedPath,
    read_json,
    restore_arrays,
    saved_shapes,
    saved_steps,
)
from zoo.engine.config import resume_step
from zoo.engine.errors import CorruptCheckpoint, ZooError, mismatches
from zoo.engine.sharding.mesh import AxisRules, variable_sharding
from zoo.engine.weights.lora import filled
from zoo.engine.weights.paths import dotted, matches

MODEL = "0"
OPTIMIZER = "1"
"""The model's part of a checkpoint's `state` item (the optimizer's is "1")."""

log = logging.getLogger("zoo")
Read = TypeVar("Read")


def read_first(
    workdir: str | os.PathLike, which: str | int, read: Callable[[int, str], Read]
) -> tuple[int, str, Read]:
    """(step, path, `read(step, path)`) of the checkpoint `which` names (see `locate`). For
    `latest`, a checkpoint that cannot be read (damaged, truncated, checksums that do not match)
    is skipped with a warning for the one before it; a step asked for by name is not."""
    quiet_storage_noise()
    step, path = locate(workdir, which)
    directory = os.path.dirname(path)
    candidates = [s for s in reversed(saved_steps(directory))] if str(which) == "latest" else [step]
    unreadable: list[tuple[int, str, str]] = []
    for step in candidates:
        path = os.path.join(directory, str(step))
        try:
            result = read(step, path)
        except Exception as e:  # bad input is re-raised; damage falls back
            if isinstance(e, ZooError) and not isinstance(e, CorruptCheckpoint):
                raise
            unreadable.append((step, path, reason(e)))
            continue
        for bad_step, bad_path, why in unreadable:
            log.warning(
                "Skipped the checkpoint at step %d (%s), which cannot be read (%s); using step "
                "%d. Nothing was changed.",
                bad_step,
                bad_path,
                why,
                step,
            )
        return step, path, result
    if len(unreadable) == 1:
        step, path, why = unreadable[0]
        raise ZooError(f"Cannot read the checkpoint at step {step} ({path}): {why}.")
    details = "; ".join(f"step {s} at {p}: {w}" for s, p, w in unreadable)
    raise ZooError(
        f"No checkpoint of the run in {directory} can be read ({details}). Nothing was changed."
    )


def locate(workdir: str | os.PathLike, which: str | int = "latest") -> tuple[int, str]:
    """(step, path) of the checkpoint of the run in `workdir` that `which` names: `latest`,
    `best` (by the run's trainer.best_metric, else its eval loss) or a step number."""
    workdir = os.path.abspath(workdir)
    directory = os.path.join(workdir, "checkpoints")
    steps = saved_steps(directory)
    if not steps:
        found = sorted(os.listdir(workdir)) if os.path.isdir(workdir) else None
        holds = (
            "it does not exist"
            if found is None
            else f"it holds {', '.join(found)}"
            if found
            else "it is empty"
        )
        raise ZooError(
            f"No checkpoint of a zoo run in {workdir}: looked for {directory}/<step>/, but "
            f"{holds}. Give the workdir of a run that has saved a checkpoint."
        )
    which = str(which)
    if which == "latest":
        step = steps[-1]
    elif which == "best":
        step = _best(directory, steps)
    elif resume_step(which) is not None:
        step = int(which)
        if step not in steps:
            raise ZooError(
                f"No checkpoint at step {step} in {directory}; saved steps: "
                f"{', '.join(map(str, steps))}."
            )
    else:
        raise ZooError(f"Checkpoint '{which}' must be 'latest', 'best' or a step number.")
    return step, os.path.join(directory, str(step))


def _best(directory: str, steps: list[int]) -> int:
    trainer = read_json(os.path.join(directory, str(steps[-1])), "config")["trainer"]
    metric = trainer.get("best_metric") or "loss"
    sign = -1 if (trainer.get("best_mode") == "max" and trainer.get("best_metric")) else 1
    scored = []
    for step in steps:
        evaluated = read_json(os.path.join(directory, str(step)), "meta").get("eval", {})
        value = evaluated.get("metrics", {}).get(metric)
        if evaluated.get("step") == step and value is not None and not math.isnan(value):
            scored.append((sign * value, step))
    if not scored:
        raise ZooError(
            f"No checkpoint in {directory} was saved with an eval of '{metric}' (steps "
            f"{', '.join(map(str, steps))}), so none is the best; use 'latest' or a step."
        )
    best = min(scored)[1]
    if not trainer.get("best_metric"):
        log.warning(
            "Checkpoint 'best': the run in %s set no trainer.best_metric, so none was kept for "
            "being best; using step %d, the lowest eval loss among the checkpoints it kept (%s).",
            os.path.dirname(directory),
            best,
            ", ".join(map(str, steps)),
        )
    return best


def restore_model(
    model: nnx.Module, step_path: str, mesh: Mesh | None = None, rules: AxisRules | None = None
) -> None:
    """Every variable of `model` (params, statistics, RNG streams) from the checkpoint, in place;
    the model must have the structure of the one saved there. An abstract model
    (`nnx.eval_shape`, no arrays to initialise only to be overwritten) needs `mesh` and `rules`,
    which give each variable the sharding of its logical axes."""
    variables = [(tuple(map(str, path)), v) for path, v in nnx.to_flat_state(nnx.state(model))]
    _restore_into(step_path, variables, mesh=mesh, rules=rules)


def restore_averaged(model: nnx.Module, step_path: str, decay: float) -> None:
    """Replace `model`'s params by their average (`optimizer.ema_decay`) saved in the optimizer
    state at `step_path`, in place; params the run did not train keep their values."""
    saved = saved_shapes(step_path)
    ema = _ema_link(saved)
    count_path = (*ema, "count")
    averaged = []
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        key = (*ema, "average", *map(str, path))
        if key in saved:
            averaged.append((key, variable))
    targets = {  # float32: the average of bfloat16 params is (`zoo.engine.weights.master`)
        key: jax.ShapeDtypeStruct(
            v.shape, jnp.promote_types(v.dtype, jnp.float32), sharding=v[...].sharding
        )
        for key, v in averaged
    }
    mesh = averaged[0][1][...].sharding.mesh
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    targets[count_path] = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    arrays = restore_arrays(step_path, targets)
    count = int(arrays[count_path])
    if count == 0:
        return  # nothing averaged yet: the params are their own average
    for key, variable in averaged:
        variable[...] = (arrays[key] / (1 - decay**count)).astype(variable.dtype)


def _ema_link(saved: Mapping[SavedPath, Any]) -> SavedPath:
    """Where the EMA link's state is saved: the last of the optimizer's chain, inside the master
    weights' state where the run kept them (`zoo.engine.weights.master`)."""
    inner = (OPTIMIZER, "opt_state", "inner")
    return (*inner, "1") if any(key[:3] == inner for key in saved) else (*inner[:2], "1")


def warm_start(
    model: nnx.Module,
    step_path: str,
    reinit: Sequence[str] = (),
    option: str = "reinit",
    mesh: Mesh | None = None,
    rules: AxisRules | None = None,
) -> list[str]:
    """Restore `model`'s params and BatchNorm statistics from the checkpoint at `step_path`, in
    place, except those `reinit` matches (and LoRA adapters, which no plain run has); returns
    the paths left as initialised. The model may wrap layers in adapters: a wrapped layer's
    params are looked up by their path without the wrapper's `base_module`, and a quantized
    kernel (QLoRA) is quantized from the saved one. An abstract model (`nnx.eval_shape`) needs
    `mesh` and `rules`, which give each param the sharding of its logical axes."""
    saved = {path[1:]: shape for path, shape in saved_shapes(step_path).items() if path[0] == MODEL}
    wanted, fresh, missing, differ = [], [], [], []
    modules: set[str] = set()  # of the params that do not fit
    used: set[SavedPath] = set()
    for path, variable in filled(model, ...):
        key = tuple(str(part) for part in path)
        used.add(key)
        if isinstance(variable, nnx.RngState | nnx.LoRAParam):
            continue
        shape = tuple(variable.shape)
        if any(matches(pattern, key) for pattern in reinit):
            fresh.append(dotted(key))
        elif key not in saved:
            missing.append(dotted(key))
            modules.add(dotted(key[:-1]))
        elif saved[key] != shape:
            differ.append(f"{dotted(key)} (checkpoint {saved[key]}, model {shape})")
            modules.add(dotted(key[:-1]))
        else:
            wanted.append((key, variable))
    extra = [
        dotted(key)
        for key in saved
        if key not in used and not any(matches(pattern, key) for pattern in reinit)
    ]
    modules.update(name.rsplit(".", 1)[0] for name in extra)
    problems = mismatches(
        ("param(s) whose shapes differ", differ),
        ("param(s) of the model that the checkpoint lacks", missing),
        ("param(s) in the checkpoint that the model lacks", extra),
    )
    if problems:
        names = sorted(modules)
        raise ZooError(
            f"Cannot start from the checkpoint {step_path}: it does not fit the model, with "
            f"{problems}. To start these fresh instead (a new head, for a new "
            f"number of classes), name them in {option}, e.g. {option}=[{','.join(names)}]; "
            "otherwise build the model as the checkpoint's run did."
        )
    wanted = [((MODEL, *key), variable) for key, variable in wanted]
    _restore_into(step_path, wanted, prefix=False, mesh=mesh, rules=rules)
    return fresh


def _restore_into(
    step_path: str,
    variables: list[tuple[SavedPath, Any]],
    prefix: bool = True,
    mesh: Mesh | None = None,
    rules: AxisRules | None = None,
) -> None:
    """Each variable set to its saved array, restored straight into its sharding (an abstract
    variable's: that of its logical axes, see `variable_sharding`)."""
    paths = [(MODEL, *path) if prefix else path for path, _ in variables]
    targets = {
        path: jax.ShapeDtypeStruct(
            v.shape, v.dtype, sharding=variable_sharding(v, dotted(path), mesh, rules)
        )
        for path, (_, v) in zip(paths, variables, strict=True)
    }
    arrays = restore_arrays(step_path, targets)
    for path, (_, variable) in zip(paths, variables, strict=True):
        variable.set_value(arrays[path])

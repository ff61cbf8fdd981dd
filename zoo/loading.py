"""`zoo.load`: a run's model from its checkpoint, or a pretrained directory's (a hub name
too), on the mesh asked for.

A run's model is rebuilt from the config its checkpoint saved (`saved_config`) and its weights
restored straight into their shardings. A pretrained directory's load is planned
(`plan_pretrained`: the abstract model, its fill and the host pages it takes) from what its
config.json implies, so that its tensors are copied while Hydra composes the run's config.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import jax
from flax import nnx
from omegaconf import DictConfig, OmegaConf

from zoo.engine import registry, sharding, weights
from zoo.engine.checkpoints import read_first, read_json, restore_averaged, restore_model
from zoo.engine.config import Config, MeshConfig, checked_dict, checked_params
from zoo.engine.errors import ZooError
from zoo.engine.loop import abstract_model
from zoo.engine.weights import PAGE, Prefaulted
from zoo.hub import local
from zoo.overrides import compose
from zoo.pretrained import is_pretrained_dir
from zoo.trained import TrainedModel, resolved_hparams


def load(
    workdir: str | os.PathLike,
    step: str | int = "latest",
    *,
    mesh: Mapping[str, Any] | None = None,
    devices: Any = None,
    weights: str = "raw",
    model: Mapping[str, Any] | None = None,
) -> TrainedModel:
    """The model of the run in `workdir` (the CLI's or the Python API's) with its weights from
    the checkpoint `step` names (`latest`, `best` or a step number) and its resolved config.
    `weights="ema"`: the average of the params that `optimizer.ema_decay` kept, in place of the
    params themselves.
    `best` is the one the run kept by its `trainer.best_metric`; for a run without one, the
    kept checkpoint with the lowest eval loss, and a warning says so.

    It is placed on a new mesh: `mesh` takes the keys of the `mesh` config section (default:
    data parallel over every device, whatever mesh it was trained on), `devices` restricts it to
    some devices.

    `workdir` may also be a pretrained checkpoint directory (`config.json` + safetensors of a
    family some model loads, see `zoo.list_models(families=True)`): its model, at step 0, with
    the config a run starting from it would have; or a Hugging Face Hub name,
    `hf://ORG/NAME[@REVISION]`, read from the hub's cache (downloaded first; see `zoo.hub`).
    For a checkpoint, `model` sets keys of the model's config section over what its config.json
    implies, as `model.*` overrides of a run from it would: `{"param_dtype": "bf16"}` holds the
    params in bfloat16 (half the memory), `{"context_length": 4096}` a shorter key/value cache."""
    workdir = local(workdir)
    if is_pretrained_dir(workdir):
        if weights != "raw":
            raise ZooError(
                f"weights={weights!r}: {os.path.abspath(workdir)} is a pretrained directory, "
                "which holds one set of weights and no average; use weights='raw'."
            )
        return _load_pretrained(os.path.abspath(workdir), mesh, devices, dict(model or {}))
    if model:
        raise ZooError(
            f"model={dict(model)!r}: {os.path.abspath(workdir)} is a run, whose model is loaded "
            "as it trained; model keys are for a pretrained directory or a hub name."
        )
    step_number, _, (model, config, device_mesh, rules, metrics) = read_first(
        workdir, step, lambda _, path: _read_model(path, mesh, devices, weights)
    )
    return TrainedModel(
        model, config, step_number, os.path.abspath(workdir), device_mesh, rules, metrics
    )


@dataclasses.dataclass
class PlannedLoad:
    """A pretrained directory's model before its weights: abstract (shapes and shardings, no
    arrays), built from `hparams`, with the opened checkpoint and the host pages that its fill
    takes its buffers from."""

    model: nnx.Module
    pretrained: weights.Pretrained
    hparams: dict[str, Any]
    mesh: jax.sharding.Mesh
    rules: sharding.AxisRules
    memory: Prefaulted

    def plan_fill(self) -> weights.PlannedFill:
        return weights.plan_fill(
            self.model,
            self.pretrained,
            hparams=self.hparams,
            mesh=self.mesh,
            rules=self.rules,
            new_buffer=self.memory.take,
            ready=self.memory.wait,
        )

    def finish(self, fill: weights.PlannedFill) -> nnx.Module:
        """The model with the copied buffers as its params, in eval mode."""
        fill.place()
        self.memory.release_rest()
        self.model.eval()
        return self.model

    def fill(self) -> nnx.Module:
        """The model with every param read straight into its sharding, in eval mode."""
        fill = self.plan_fill()
        fill.copy()
        return self.finish(fill)


def plan_pretrained(
    pretrained: weights.Pretrained,
    hparams: Mapping[str, Any],
    mesh: Mapping[str, Any] | None,
    devices: Any,
) -> PlannedLoad:
    """Everything `zoo.load` of a pretrained directory does before it reads a tensor, for the
    model of `hparams`; the host pages of the params are readied meanwhile, on a thread of their
    own."""
    memory = Prefaulted(_param_bytes(pretrained, hparams))
    entry = registry.get_model(hparams["name"])
    mesh_cfg = checked_dict(MeshConfig, dict(mesh or {}), "mesh")
    device_mesh, rules = sharding.mesh_and_rules(mesh_cfg, devices)
    with sharding.activate(device_mesh, rules):
        model = abstract_model(entry, hparams, Config.seed)
    sharding.check_experts_split(nnx.state(model), device_mesh, rules)
    return PlannedLoad(model, pretrained, dict(hparams), device_mesh, rules, memory)


def checkpoint_hparams(
    pretrained: weights.Pretrained, model: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The model that a run from `pretrained` composes, from its config.json, the `model` keys
    given and the model's defaults alone: Hydra's composition sets the same `model.*` keys from
    them (see `zoo.pretrained`). Sizes the checkpoint leaves to the data set are those it states
    without a config (None if it states none); one that decides them from its config may
    differ."""
    entry = registry.get_model(pretrained.family.model)
    given = {**pretrained.hparams(), **(model or {})}
    hparams = checked_params(f"model '{entry.name}'", entry.config, given)
    return entry.resolve(hparams, registry.get_data(entry.default_data))


@contextlib.contextmanager
def _collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a while. A load allocates many short-lived
    objects and leaves no cycles worth collecting meanwhile, but each collection they set off
    runs jax's callback that frees XLA's garbage (about 2 ms a collection: 0.1 s of a GPT-2
    small load)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _param_bytes(pretrained: weights.Pretrained, hparams: Mapping[str, Any]) -> int:
    """An upper bound of the bytes of a loaded model's host buffers on this process's devices:
    params of 4 bytes (2 with `param_dtype=bf16`), a page of alignment per buffer (a buffer per
    param: up to three per tensor, for a fused qkv) and 1% for padded rows and blocks. The pages
    left over are released after the fill."""
    numbers = (2 if hparams.get("param_dtype") == "bf16" else 4) * pretrained.loaded_elements()
    return numbers + numbers // 100 + 3 * len(pretrained.files) * PAGE


def _load_pretrained(
    directory: str, mesh: Mapping[str, Any] | None, devices: Any, model: dict[str, Any]
) -> TrainedModel:
    """The model of a pretrained directory, each param read straight into its sharding.

    The model is planned from what its config.json implies (`checkpoint_hparams`), so that its
    tensors are copied on a thread while Hydra composes the run's config (both take about as
    long). Where the checkpoint cannot say or the composed config differs, the model is planned
    from the composed config instead."""
    with _collection_paused():
        pretrained = weights.open_pretrained(directory)
        planned, fill = _planned_from_checkpoint(pretrained, mesh, devices, model)
        keys = [f"model.{key}={json.dumps(value)}" for key, value in model.items()]
        with contextlib.nullcontext() if fill is None else fill.copied_meanwhile():
            config = compose([f"finetune.init_from={directory}", *keys])
        hparams = resolved_hparams(config)
        if planned is None or hparams != planned.hparams:
            planned = fill = None  # its pages are given back before the new plan takes its own
            planned = plan_pretrained(pretrained, hparams, mesh, devices)
            model = planned.fill()
        else:
            model = planned.finish(fill)
    return TrainedModel(model, config, 0, directory, planned.mesh, planned.rules, {})


def _planned_from_checkpoint(
    pretrained: weights.Pretrained,
    mesh: Mapping[str, Any] | None,
    devices: Any,
    model: Mapping[str, Any],
) -> tuple[PlannedLoad, weights.PlannedFill] | tuple[None, None]:
    """The load planned from config.json alone, or (None, None) where that fails (a size the
    checkpoint leaves to the data set, weights that do not fit): the load is then planned after
    composition, whose errors (a tokenizer that does not fit, a bad value) name such faults
    better than the fill's."""
    try:
        hparams = checkpoint_hparams(pretrained, model)
        planned = plan_pretrained(pretrained, hparams, mesh, devices)
        return planned, planned.plan_fill()
    except ZooError:
        return None, None


def _read_model(
    path: str, mesh: Mapping[str, Any] | None, devices: Any, weights: str = "raw"
) -> tuple:
    """The model saved at `path` on the mesh asked for, its config and its last eval."""
    config = saved_config(path)
    decay = _averaged_weights(weights, config, path)
    entry = registry.get_model(config.model.name)
    mesh_cfg = checked_dict(MeshConfig, {"rules": dict(config.mesh.rules), **(mesh or {})}, "mesh")
    device_mesh, rules = sharding.mesh_and_rules(mesh_cfg, devices)
    hparams = resolved_hparams(config)
    with sharding.activate(device_mesh, rules):
        model = abstract_model(entry, hparams, config.seed, config.finetune)
    restore_model(model, path, device_mesh, rules)
    if decay is not None:
        restore_averaged(model, path, decay)
    model.eval()
    evaluated = read_json(path, "meta").get("eval", {})
    return model, config, device_mesh, rules, dict(evaluated.get("metrics", {}))


def _averaged_weights(weights: str, config: Any, path: str) -> float | None:
    """The EMA decay to read the params' average with, or None for the params themselves."""
    if weights not in ("raw", "ema"):
        raise ZooError(
            f"weights={weights!r} must be 'raw' (the trained params) or 'ema' (their average)."
        )
    if weights == "raw":
        return None
    decay = config.optimizer.get("ema_decay")
    if decay is None:
        raise ZooError(
            f"weights='ema' needs a run trained with optimizer.ema_decay; the run at {path} kept "
            "no average. Use weights='raw'."
        )
    return float(decay)


def saved_config(path: str) -> DictConfig:
    """A checkpoint's config, with the sections older checkpoints lack at their defaults."""
    saved = read_json(path, "config")
    defaults = OmegaConf.to_container(OmegaConf.structured(Config), enum_to_str=True)
    filled = {**{k: v for k, v in defaults.items() if k not in ("model", "data")}, **saved}
    filled["finetune"] = {**defaults["finetune"], **saved.get("finetune", {})}
    return OmegaConf.create(filled)

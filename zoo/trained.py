"""A trained model as the front holds it: `TrainedModel` (a loaded run's model, config, step,
workdir and mesh; `zoo.load` makes one), what its config resolves its model's arguments to,
and its LoRA adapters merged (`zoo.merge_lora`).

`Trained`: a loaded model or the `RunResult` a run returns, which both carry the model and the
mesh it is called under, as `predict`, `evaluate`, `merge_lora` and `finetune` take them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx
from omegaconf import DictConfig, OmegaConf

from zoo.engine import registry, sharding
from zoo.engine.loop import RunResult
from zoo.engine.weights import merge_adapters


@dataclasses.dataclass
class TrainedModel:
    """A model loaded from a run's checkpoint, in eval mode, with the config it was trained
    with. Call it inside `with loaded.activate():` (explicit sharding needs its mesh), or use
    `zoo.predict` / `zoo.evaluate`, which do."""

    model: nnx.Module
    config: DictConfig
    step: int
    workdir: str
    mesh: jax.sharding.Mesh
    rules: sharding.AxisRules
    eval_metrics: dict[str, float]  # the last eval at or before `step` ({} if none)

    def activate(self):
        """The mesh and rules the model was loaded onto: call the model inside it."""
        return sharding.activate(self.mesh, self.rules)


Trained = RunResult | TrainedModel


def resolved_hparams(config: DictConfig) -> dict[str, Any]:
    """The model's constructor arguments, with those its data set decided filled in."""
    entry = registry.get_model(config.model.name)
    hparams = OmegaConf.to_container(config.model)
    if config.data.name in registry.list_datasets():
        data_params = OmegaConf.to_container(config.data, enum_to_str=True)
        hparams = entry.resolve(hparams, registry.get_data(config.data.name), data_params)
    return hparams


def merge_lora(trained: Trained) -> Trained:
    """A copy of a fine-tuned `trained` whose model has its LoRA adapters folded into its
    layers' kernels (`kernel + lora_a @ lora_b`): the model's original structure, computing
    the same function, ready for `predict`/`evaluate`. `trained` itself keeps its adapters."""
    with trained.activate():
        merged = merge_adapters(nnx.clone(trained.model))
    return dataclasses.replace(trained, model=merged)

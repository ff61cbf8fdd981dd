"""The Python API around the trainer: train as the CLI does, load a trained model, fine-tune it,
predict and evaluate.

Everything goes through the one trainer (`train.loop.Trainer`), so a fine-tune has the CLI's
options, logs, sharding and checkpoints. A fine-tune is an ordinary run whose config's
`finetune` section says where it started and what it changes (a new head, frozen params, LoRA
adapters): `load` rebuilds its model from that config alone, and calling `finetune` again with
the same arguments and workdir resumes it exactly, as the CLI's resume does.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from omegaconf import DictConfig, OmegaConf

from data import pipeline
from train import rngs as zoo_rngs
from train import sharding
from train.checkpoint import read_json
from train.freeze import Filter
from train.loop import RunResult, Trainer, build_model, evaluate_batches, run
from train.lora import merge_adapters
from train.plan import create_sharded
from train.steps import make_eval_step
from train.warm_start import locate, restore_model
from zoo import registry
from zoo.config import Config, MeshConfig, check_finetune, checked_dict, compose
from zoo.errors import ZooError

USER_DATA = "user"
"""`data.name` in the config of a run on the caller's own data (`finetune(..., data=Splits)`)."""


def fit(model: str, *overrides: str) -> RunResult:
    """Run the CLI's job from Python: `fit("cnn", "data=digits", "trainer.steps=200")` is
    `python -m zoo.train model=cnn data=digits trainer.steps=200`, returning the trained model,
    its final eval metrics and its workdir."""
    return run(compose([f"model={model}", *overrides]))


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


def load(
    workdir: str | os.PathLike,
    step: str | int = "latest",
    *,
    mesh: Mapping[str, Any] | None = None,
    devices: Any = None,
) -> TrainedModel:
    """The model of the run in `workdir` (the CLI's or the Python API's) with its weights from
    the checkpoint `step` names (`latest`, `best` or a step number) and its resolved config.

    It is placed on a new mesh: `mesh` takes the keys of the `mesh` config section (default:
    data parallel over every device, whatever mesh it was trained on), `devices` restricts it to
    some devices."""
    step_number, path = locate(workdir, step)
    config = _saved_config(path)
    entry = registry.get_model(config.model.name)
    hparams = _resolved_hparams(config)
    mesh_cfg = checked_dict(MeshConfig, {"rules": dict(config.mesh.rules), **(mesh or {})}, "mesh")
    rules = sharding.AxisRules.from_mapping(mesh_cfg["rules"])
    device_mesh = sharding.make_mesh(mesh_cfg, devices)
    with sharding.activate(device_mesh, rules):
        (model,), _ = create_sharded(
            lambda: (build_model(entry, hparams, config.seed, config.finetune),),
            device_mesh,
            rules,
        )
    restore_model(model, path)
    model.eval()
    evaluated = read_json(path, "meta").get("eval", {})
    return TrainedModel(
        model,
        config,
        step_number,
        os.path.abspath(workdir),
        device_mesh,
        rules,
        dict(evaluated.get("metrics", {})),
    )


def finetune(
    start: str | os.PathLike | Trained,
    *overrides: str,
    data: str | registry.Splits | None = None,
    step: str | int | None = None,
    num_classes: int | None = None,
    replace_head: bool = False,
    reinit: tuple[str, ...] = (),
    freeze: str | Filter | None = None,
    lora_rank: int = 0,
    lora_layers: str = ".*",
) -> RunResult:
    """Fine-tune a trained model (or train a fresh one) with the trainer, as one more run.

    - `start`: the workdir of a run, a `RunResult` or `TrainedModel` (its weights at its step),
      or a registered model's name (fresh weights; its `model.*` keys from `overrides`).
    - `overrides`: the CLI's keys, e.g. `"trainer.steps=200"`, `"optimizer.learning_rate=1e-3"`,
      `"workdir=runs/ft"`, `"mesh.fsdp=2"`; the model's own defaults fill the rest.
    - `data`: a registered data set's name (its `input_shape` and `num_classes` then decide the
      model's; `"data=NAME"` among the overrides says the same), or `zoo.Splits` of your own: columns of arrays or random-access sources (a Grain
      `MapDataset`, ...), batched, sharded and shuffled as the zoo's own data are; an `image`
      column decides `input_shape` (a fresh model on your own data needs `num_classes`).
      Default: the start run's data set.
    - `step`: which of the start run's checkpoints (`latest`, `best`, a step number).
    - `num_classes`: a new number of classes; with `replace_head` the head starts fresh
      (`reinit` names other params to start fresh). A param whose shape differs from the
      checkpoint's and that is not named so is an error.
    - `freeze`: params that get no gradient and no optimizer state: a path pattern, `backbone`
      (every param outside the head), or an NNX filter.
    - `lora_rank` > 0: add LoRA adapters to the Linear layers `lora_layers` matches and train
      only them and the fresh params; `zoo.merge_lora` folds them in afterwards.

    Running the same call again with the same workdir resumes it (a finished run returns at
    once), as the CLI does."""
    named = [o for o in overrides if o.startswith("data=")]
    if named and data is None:  # `data=NAME` among the overrides, as on the command line
        data, overrides = named[-1].partition("=")[2], tuple(o for o in overrides if o not in named)
    workdir, step_number, base = _start(start, step)
    name = base.model.name if base is not None else str(start)
    user_data = isinstance(data, registry.Splits)
    if base is not None and data is None and base.data.name not in registry.list_datasets():
        raise ZooError(
            f"The run in {workdir} trained on data of its own ('{base.data.name}'): pass the "
            "data to fine-tune on as data=zoo.Splits(...) or a registered data set's name."
        )
    args = [f"model={name}"]
    data_name = data if isinstance(data, str) else base.data.name if base is not None else None
    if data_name is not None and data_name in registry.list_datasets():
        args.append(f"data={data_name}")
    given = {o.split("=")[0].lstrip("+~") for o in overrides}
    if num_classes is not None:
        given.add("model.num_classes")
    if base is not None:
        decided = _data_decides(data, user_data)
        for key, value in _resolved_hparams(base).items():
            if key != "name" and key not in decided and f"model.{key}" not in given:
                args.append(f"model.{key}={json.dumps(value)}")
    if user_data:
        args += [f"model.{k}={json.dumps(v)}" for k, v in _user_data_facts(data).items()]
    if num_classes is not None:
        args.append(f"model.num_classes={num_classes}")
    cfg = compose([*args, *overrides])
    settings = cfg.finetune
    if workdir is not None:
        settings.init_from, settings.init_step = workdir, str(step_number)
    settings.reinit = [*reinit, *([settings.head] if replace_head else [])]
    settings.freeze = freeze if isinstance(freeze, str) else None
    settings.lora_rank, settings.lora_layers = lora_rank, lora_layers
    check_finetune(settings)
    if freeze is not None and not isinstance(freeze, str):
        settings.freeze = repr(freeze)  # a filter is code: the config records what it is
    if user_data:
        cfg = _on_user_data(cfg, data)
    frozen = None if freeze is None or isinstance(freeze, str) else freeze
    return Trainer(cfg, data=data if user_data else None, freeze=frozen).fit()


def merge_lora(trained: Trained) -> nnx.Module:
    """Fold the LoRA adapters of a fine-tuned model into its layers' kernels (in place): the
    model then has its original structure and computes the same function."""
    with trained.activate():
        return merge_adapters(trained.model)


@nnx.jit
def _forward(model: nnx.Module, inputs: jax.Array) -> jax.Array:
    return model(inputs)


def predict(trained: Trained, inputs: np.ndarray) -> np.ndarray:
    """The model's outputs (logits) for a batch of inputs as the model takes them (e.g.
    normalised images: a data set's `transform` makes them), on the model's mesh."""
    inputs = np.asarray(inputs)
    shards = sharding.batch_divisor(trained.mesh, trained.rules)
    padding = -len(inputs) % shards
    padded = np.concatenate([inputs, np.repeat(inputs[-1:], padding, axis=0)])
    with trained.activate():
        batch = sharding.shard_batch({"inputs": padded}, trained.mesh, trained.rules)
        outputs = _forward(trained.model, batch["inputs"])
    return np.asarray(jax.device_get(outputs))[: len(inputs)]


def evaluate(
    trained: Trained,
    data: str | registry.Splits | Mapping[str, np.ndarray] | pipeline.RandomAccess,
    batch_size: int | None = None,
) -> dict[str, float]:
    """The model's eval metrics (its loss and metrics, each example counted once) on a
    registered data set's eval split, the eval split of `Splits` (with its `transform`), or
    columns / a random-access source as the model takes them."""
    config = trained.config
    transform = None
    if isinstance(data, str):
        data = registry.get_data(data).splits({})
    if isinstance(data, registry.Splits):
        data, transform = data.eval, data.transform
    shards = sharding.batch_divisor(trained.mesh, trained.rules)
    size = batch_size or -(-int(config.trainer.batch_size) // shards) * shards
    batches = pipeline.eval_batches(data, size, transform=transform)
    graphdef, state = nnx.split((trained.model, None))
    eval_step = make_eval_step(graphdef, registry.get_model(config.model.name).loss)
    key = zoo_rngs.eval_key(int(config.seed))
    return evaluate_batches(eval_step, state, batches, trained.mesh, trained.rules, key)


def _start(start: Any, step: str | int | None) -> tuple[str | None, int | None, DictConfig | None]:
    """(workdir, step, its config) of the run a fine-tune starts from; Nones for a fresh one."""
    if isinstance(start, RunResult | TrainedModel):
        workdir, which = start.workdir, start.step if step is None else step
    elif isinstance(start, str) and start in registry.list_models():
        if step is not None:
            raise ZooError(f"A fresh '{start}' has no checkpoints: step={step!r} is not for it.")
        return None, None, None
    else:
        workdir, which = os.fspath(start), "latest" if step is None else step
    step_number, path = locate(workdir, which)
    return os.path.abspath(workdir), step_number, _saved_config(path)


def _saved_config(path: str) -> DictConfig:
    """A checkpoint's config, with the sections older checkpoints lack at their defaults."""
    saved = read_json(path, "config")
    defaults = OmegaConf.to_container(OmegaConf.structured(Config), enum_to_str=True)
    filled = {**{k: v for k, v in defaults.items() if k not in ("model", "data")}, **saved}
    filled["finetune"] = {**defaults["finetune"], **saved.get("finetune", {})}
    return OmegaConf.create(filled)


def _resolved_hparams(config: DictConfig) -> dict[str, Any]:
    """The model's constructor arguments, with those its data set decided filled in."""
    entry = registry.get_model(config.model.name)
    hparams = OmegaConf.to_container(config.model)
    if config.data.name in registry.list_datasets():
        hparams = entry.resolve(hparams, registry.get_data(config.data.name))
    return hparams


def _data_decides(data: Any, user_data: bool) -> set[str]:
    """The model parameters that the fine-tune's data decides instead of the start run."""
    if isinstance(data, str):
        return set(registry.get_data(data).info)
    if user_data:
        return set(_user_data_facts(data))
    return set()


def _user_data_facts(splits: registry.Splits) -> dict[str, Any]:
    """What the caller's data tells the model: `input_shape`, from an `image` column."""
    first = splits.train if isinstance(splits.train, Mapping) else splits.train[0]
    if "image" not in first:
        return {}
    image = np.asarray(first["image"])
    shape = image.shape[1:] if isinstance(splits.train, Mapping) else image.shape
    if splits.transform is not None:  # the model sees transformed images
        sample = {"image": (image[:1] if isinstance(splits.train, Mapping) else image[None])}
        shape = np.asarray(splits.transform(sample)["image"]).shape[1:]
    return {"input_shape": list(shape)}


def _on_user_data(cfg: DictConfig, splits: registry.Splits) -> DictConfig:
    """The config of a run on the caller's data: `data` names it `user` with its sizes (a
    resumed run must see data of the same sizes)."""
    container = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    container["data"] = {
        "name": USER_DATA,
        "train_examples": len(_first_column(splits.train)),
        "eval_examples": len(_first_column(splits.eval)),
    }
    return OmegaConf.create(container)


def _first_column(data: Any) -> Any:
    return next(iter(data.values())) if isinstance(data, Mapping) else data

"""The Python API around the trainer: train as the CLI does, build a fresh model, load a
trained one, predict and evaluate (fine-tuning is `zoo.tuning`).

Everything goes through the one trainer (`zoo.engine.loop.Trainer`) and the one way to build a model
on a mesh (`zoo.engine.build`), so a model loaded here is the one its run trained, on any mesh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from omegaconf import DictConfig, OmegaConf

from zoo.engine import pipeline, registry, rundir, sharding, weights
from zoo.engine import rngs as zoo_rngs
from zoo.engine.build import abstract_model, build_on_mesh
from zoo.engine.checkpoints.reader import read_json
from zoo.engine.checkpoints.warm_start import read_first, restore_averaged, restore_model
from zoo.engine.config import Config, MeshConfig, checked_dict, checked_params
from zoo.engine.console import ConsoleHandler
from zoo.engine.errors import ZooError
from zoo.engine.host_memory import PAGE, Prefaulted
from zoo.engine.loop import RunResult, Trainer, evaluate_batches
from zoo.engine.lora import merge_adapters
from zoo.engine.steps import make_eval_step
from zoo.engine.validate import check_split
from zoo.overrides import compose


def fit(model: str, *overrides: str, callbacks: Sequence[Any] = ()) -> RunResult:
    """Run the CLI's job from Python: `fit("cnn", "data=digits", "trainer.steps=200")` is
    `python -m zoo.train model=cnn data=digits trainer.steps=200`, returning the trained model,
    its final eval metrics and its workdir. It prints what the CLI prints and writes what the
    CLI writes (`train.log`, `.hydra/`). `callbacks`: see "Callbacks" in the README."""
    args = [f"model={model}", *overrides]
    with console_logging(), rundir.RunLog() as run_log:
        trainer = Trainer(compose(args), callbacks=callbacks)
        return trainer.fit(overrides=args, run_log=run_log)


def run(cfg: DictConfig) -> RunResult:
    """Train a composed config (`zoo.compose([...])`) as the CLI does, printing its lines."""
    with console_logging(), rundir.RunLog() as run_log:
        return Trainer(cfg).fit(run_log=run_log)


@contextlib.contextmanager
def console_logging() -> Iterator[None]:
    """The CLI's console lines (progress, evals, warnings) for a run started from Python, and
    in its `train.log`: zoo's logger at INFO while the run lasts, shown by the CLI's console
    handler unless the program has set up logging of its own (a root handler other than the
    bare one `logging.basicConfig()` makes, which absl installs on import)."""
    zoo_log, root = logging.getLogger("zoo"), logging.getLogger()
    level = zoo_log.level
    if zoo_log.getEffectiveLevel() > logging.INFO:
        zoo_log.setLevel(logging.INFO)
    bare = list(root.handlers)
    ours = all(_is_bare(handler) for handler in bare)
    console = ConsoleHandler()
    console.setFormatter(logging.Formatter("%(message)s"))
    if ours:
        for handler in bare:
            root.removeHandler(handler)
        root.addHandler(console)
    try:
        yield
    finally:
        zoo_log.setLevel(level)
        if ours:
            root.removeHandler(console)
            for handler in bare:
                root.addHandler(handler)


def _is_bare(handler: logging.Handler) -> bool:
    """A handler as `logging.basicConfig()` makes it: stderr, the default format."""
    formatter = handler.formatter
    return (
        type(handler) is logging.StreamHandler
        and formatter is not None
        and formatter._fmt == logging.BASIC_FORMAT
    )


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
    weights: str = "raw",
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
    the config a run starting from it would have."""
    if is_pretrained_dir(workdir):
        if weights != "raw":
            raise ZooError(
                f"weights={weights!r}: {os.path.abspath(workdir)} is a pretrained directory, "
                "which holds one set of weights and no average; use weights='raw'."
            )
        return _load_pretrained(os.path.abspath(workdir), mesh, devices)
    step_number, _, (model, config, device_mesh, rules, metrics) = read_first(
        workdir, step, lambda _, path: _read_model(path, mesh, devices, weights)
    )
    return TrainedModel(
        model, config, step_number, os.path.abspath(workdir), device_mesh, rules, metrics
    )


def is_pretrained_dir(path: str | os.PathLike) -> bool:
    """Whether `path` is a pretrained checkpoint directory rather than a run's workdir (an
    exported run may hold both: its checkpoints win)."""
    return weights.is_pretrained(path) and not os.path.isdir(os.path.join(path, "checkpoints"))


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
    memory = Prefaulted(_param_bytes(pretrained))
    entry = registry.get_model(hparams["name"])
    mesh_cfg = checked_dict(MeshConfig, dict(mesh or {}), "mesh")
    device_mesh, rules = sharding.mesh_and_rules(mesh_cfg, devices)
    with sharding.activate(device_mesh, rules):
        model = abstract_model(entry, hparams, Config.seed)
    return PlannedLoad(model, pretrained, dict(hparams), device_mesh, rules, memory)


def checkpoint_hparams(pretrained: weights.Pretrained) -> dict[str, Any]:
    """The model that a run from `pretrained` composes, from its config.json and the model's
    defaults alone: Hydra's composition sets the same `model.*` keys from them (see
    `zoo.pretrained`). Sizes the checkpoint leaves to the data set are those it states without
    a config (None if it states none); one that decides them from its config may differ."""
    entry = registry.get_model(pretrained.family.model)
    hparams = checked_params(f"model '{entry.name}'", entry.config, pretrained.hparams())
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


def _param_bytes(pretrained: weights.Pretrained) -> int:
    """An upper bound of the bytes of a loaded model's host buffers on this process's devices:
    float32 params, a page of alignment per buffer (a buffer per param: up to three per tensor,
    for a fused qkv) and 1% for padded rows and blocks. The pages left over are released after
    the fill."""
    numbers = 4 * pretrained.loaded_elements()
    return numbers + numbers // 100 + 3 * len(pretrained.files) * PAGE


def _load_pretrained(directory: str, mesh: Mapping[str, Any] | None, devices: Any) -> TrainedModel:
    """The model of a pretrained directory, each param read straight into its sharding.

    The model is planned from what its config.json implies (`checkpoint_hparams`), so that its
    tensors are copied on a thread while Hydra composes the run's config (both take about as
    long). Where the checkpoint cannot say or the composed config differs, the model is planned
    from the composed config instead."""
    with _collection_paused():
        pretrained = weights.open_pretrained(directory)
        planned, fill = _planned_from_checkpoint(pretrained, mesh, devices)
        with contextlib.nullcontext() if fill is None else fill.copied_meanwhile():
            config = compose([f"finetune.init_from={directory}"])
        hparams = resolved_hparams(config)
        if planned is None or hparams != planned.hparams:
            planned = fill = None  # its pages are given back before the new plan takes its own
            planned = plan_pretrained(pretrained, hparams, mesh, devices)
            model = planned.fill()
        else:
            model = planned.finish(fill)
    return TrainedModel(model, config, 0, directory, planned.mesh, planned.rules, {})


def _planned_from_checkpoint(
    pretrained: weights.Pretrained, mesh: Mapping[str, Any] | None, devices: Any
) -> tuple[PlannedLoad, weights.PlannedFill] | tuple[None, None]:
    """The load planned from config.json alone, or (None, None) where that fails (a size the
    checkpoint leaves to the data set, weights that do not fit): the load is then planned after
    composition, whose errors (a tokenizer that does not fit, a bad value) name such faults
    better than the fill's."""
    try:
        planned = plan_pretrained(pretrained, checkpoint_hparams(pretrained), mesh, devices)
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


def merge_lora(trained: Trained) -> Trained:
    """A copy of a fine-tuned `trained` whose model has its LoRA adapters folded into its
    layers' kernels (`kernel + lora_a @ lora_b`): the model's original structure, computing
    the same function, ready for `predict`/`evaluate`. `trained` itself keeps its adapters."""
    with trained.activate():
        merged = merge_adapters(nnx.clone(trained.model))
    return dataclasses.replace(trained, model=merged)


@nnx.jit
def _forward(model: nnx.Module, inputs: jax.Array) -> jax.Array:
    return model(inputs)


def predict(trained: Trained, inputs: np.ndarray) -> np.ndarray:
    """The model's outputs (logits) for a batch of inputs as the model takes them (e.g.
    normalised float images, N x H x W x C: a data set's `transform` makes them), on the
    model's mesh. Raw integer pixels and inputs of another shape are refused by name."""
    inputs = np.asarray(inputs)
    check_images(inputs, resolved_hparams(trained.config).get("input_shape"), trained.config)
    shards = sharding.batch_divisor(trained.mesh, trained.rules)
    padding = -len(inputs) % shards
    padded = np.concatenate([inputs, np.repeat(inputs[-1:], padding, axis=0)])
    with trained.activate():
        batch = sharding.shard_batch({"inputs": padded}, trained.mesh, trained.rules)
        outputs = _forward(trained.model, batch["inputs"])
    return np.asarray(jax.device_get(outputs))[: len(inputs)]


def check_images(inputs: np.ndarray, input_shape: Any, config: DictConfig) -> None:
    """Images for an image model: a batch (N, *input_shape) of floats, as the model was trained
    on (after its data set's `transform`)."""
    if input_shape is None:
        return
    shape, wanted = tuple(inputs.shape), tuple(input_shape)
    if shape == wanted:
        raise ZooError(
            f"predict takes a batch of inputs: got one image of shape {shape}; add the batch "
            f"axis (inputs[None], shape (1, {', '.join(map(str, wanted))})). The model's "
            f"input_shape is {list(wanted)}."
        )
    if shape[1:] != wanted:
        raise ZooError(
            f"predict got inputs of shape {shape}; model '{config.model.name}' takes a batch "
            f"(N, {', '.join(map(str, wanted))}): its input_shape is {list(wanted)} (height, "
            "width, channels). Add a missing channel axis with images[..., None], and resize "
            "images of another size."
        )
    if not np.issubdtype(inputs.dtype, np.floating):
        name = config.data.name
        how = (
            f'zoo.load_data("{name}").transform({{"image": images}})["image"]'
            if name in registry.list_datasets()
            else "the transform its training data had"
        )
        raise ZooError(
            f"predict got {inputs.dtype} images; model '{config.model.name}' takes float "
            f"images normalised as in training. Normalise them first: {how}."
        )


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
    entry = registry.get_model(config.model.name)
    check_split(entry, "eval", data, resolved_hparams(config))
    shards = sharding.batch_divisor(trained.mesh, trained.rules)
    size = batch_size or -(-int(config.trainer.batch_size) // shards) * shards
    batches = pipeline.eval_batches(data, size, transform=transform)
    graphdef, state = nnx.split((trained.model, None))
    eval_step = make_eval_step(graphdef, registry.get_model(config.model.name).loss)
    key = zoo_rngs.eval_key(int(config.seed))
    return evaluate_batches(eval_step, state, batches, trained.mesh, trained.rules, key)


def saved_config(path: str) -> DictConfig:
    """A checkpoint's config, with the sections older checkpoints lack at their defaults."""
    saved = read_json(path, "config")
    defaults = OmegaConf.to_container(OmegaConf.structured(Config), enum_to_str=True)
    filled = {**{k: v for k, v in defaults.items() if k not in ("model", "data")}, **saved}
    filled["finetune"] = {**defaults["finetune"], **saved.get("finetune", {})}
    return OmegaConf.create(filled)


def resolved_hparams(config: DictConfig) -> dict[str, Any]:
    """The model's constructor arguments, with those its data set decided filled in."""
    entry = registry.get_model(config.model.name)
    hparams = OmegaConf.to_container(config.model)
    if config.data.name in registry.list_datasets():
        data_params = OmegaConf.to_container(config.data, enum_to_str=True)
        hparams = entry.resolve(hparams, registry.get_data(config.data.name), data_params)
    return hparams


def load_data(name: str, **params: Any) -> registry.Splits:
    """A registered data set's splits, e.g. `load_data("digits")`; `params` are its `data.*`
    keys (`load_data("fashion_mnist", download=False)`), type-checked."""
    entry = registry.get_data(name)
    return entry.splits(checked_params(f"data set '{name}'", entry.config, params))


def create_model(
    name: str,
    *,
    data: str | None = None,
    seed: int = 0,
    mesh: Mapping[str, Any] | None = None,
    devices: Any = None,
    **overrides: Any,
) -> nnx.Module:
    """Build a registered model with fresh parameters, e.g. `create_model("xor", num_hidden=16)`.

    Parameters the data set decides (`input_shape`, `num_classes`) come from `data` (default: the
    model's own default data set) unless given.

    The params are born sharded on a device mesh, as their logical annotations and the rules
    ask; `mesh` takes the keys of the `mesh` config section (default: data parallel over every
    device), `devices` restricts it to some devices. Call the model under
    `zoo.engine.sharding.activate(...)` (or use the trainer), since explicit sharding needs a mesh.
    """
    entry = registry.get_model(name)
    hparams = checked_params(f"model '{name}'", entry.config, overrides)
    hparams = entry.resolve(hparams, registry.get_data(data or entry.default_data))
    device_mesh, rules = sharding.mesh_and_rules(
        checked_dict(MeshConfig, dict(mesh or {}), "mesh"), devices
    )
    return build_on_mesh(entry, hparams, seed, device_mesh, rules).model

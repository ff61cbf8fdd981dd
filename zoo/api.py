"""The Python API around the trainer: train as the CLI does, build a fresh model, load a
trained one, predict and evaluate (fine-tuning is `zoo.tuning`).

Everything goes through the one trainer (`zoo.engine.loop.trainer.Trainer`) and the one way to build a model
on a mesh (`zoo.engine.loop.build`), so a model loaded here is the one its run trained, on any mesh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from omegaconf import DictConfig, OmegaConf

from zoo.engine import pipeline, registry, sharding, weights
from zoo.engine.checkpoints import read_first, read_json, restore_averaged, restore_model
from zoo.engine.config import Config, MeshConfig, checked_dict, checked_params
from zoo.engine.errors import ZooError
from zoo.engine.loop import (
    RunLog,
    RunResult,
    Trainer,
    abstract_model,
    build_on_mesh,
    check_split,
    evaluate_batches,
)
from zoo.engine.report import ConsoleHandler
from zoo.engine.steps import eval_key, make_eval_step
from zoo.engine.weights import PAGE, Prefaulted, merge_adapters
from zoo.hub import local
from zoo.overrides import compose
from zoo.pretrained import is_pretrained_dir


def fit(model: str, *overrides: str, callbacks: Sequence[Any] = ()) -> RunResult:
    """Run the CLI's job from Python: `fit("cnn", "data=digits", "trainer.steps=200")` is
    `python -m zoo.train model=cnn data=digits trainer.steps=200`, returning the trained model,
    its final eval metrics and its workdir. It prints what the CLI prints and writes what the
    CLI writes (`train.log`, `.hydra/`). `callbacks`: see "Callbacks" in the README."""
    args = [f"model={model}", *overrides]
    with console_logging(), RunLog() as run_log:
        trainer = Trainer(compose(args), callbacks=callbacks)
        return trainer.fit(overrides=args, run_log=run_log)


def run(cfg: DictConfig) -> RunResult:
    """Train a composed config (`zoo.compose([...])`) as the CLI does, printing its lines."""
    with console_logging(), RunLog() as run_log:
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


def merge_lora(trained: Trained) -> Trained:
    """A copy of a fine-tuned `trained` whose model has its LoRA adapters folded into its
    layers' kernels (`kernel + lora_a @ lora_b`): the model's original structure, computing
    the same function, ready for `predict`/`evaluate`. `trained` itself keeps its adapters."""
    with trained.activate():
        merged = merge_adapters(nnx.clone(trained.model))
    return dataclasses.replace(trained, model=merged)


@nnx.jit
def _forward(model: nnx.Module, inputs: jax.Array) -> Any:
    return model(inputs)


def predict(trained: Trained, inputs: np.ndarray) -> Any:
    """The model's outputs (logits; a tuple of arrays for a model that returns several, such as
    `vae`) for a batch of inputs as the model takes them (e.g. normalised float images,
    N x H x W x C: a data set's `transform` makes them), on the model's mesh.

    Inputs the model cannot take are refused by name before it runs (see `Reads`): strings
    and other non-numbers, one example without its batch axis, a shape or width it cannot
    take, raw integer pixels, token ids that are not integers of its vocabulary.
    A language model's logits have one column per token of its vocabulary (`vocab_size`)."""
    reads = Reads.of(trained.config)
    inputs = reads.check(inputs, "predict got inputs")
    if not reads.decides(inputs):
        graphdef, state = nnx.split(trained.model)
        with trained.activate():
            reads.check_traced(graphdef, state, inputs, "predict got inputs")
    shards = sharding.batch_divisor(trained.mesh, trained.rules)
    padding = -len(inputs) % shards
    padded = np.concatenate([inputs, np.repeat(inputs[-1:], padding, axis=0)])
    with trained.activate():
        batch = sharding.shard_batch({"inputs": padded}, trained.mesh, trained.rules)
        outputs = _forward(trained.model, batch["inputs"])
    outputs = jax.tree.map(lambda x: np.asarray(x)[: len(inputs)], jax.device_get(outputs))
    return within_vocabulary(trained.model, outputs)


def within_vocabulary(model: nnx.Module, outputs: Any) -> Any:
    """A language model's logits over its vocabulary alone: a model whose embedding has rows
    past its `vocab_size` (padded so that it shards) masks their logits, and they are dropped."""
    vocab = getattr(model, "vocab_size", None)
    if not isinstance(vocab, int) or not isinstance(outputs, np.ndarray | jax.Array):
        return outputs
    return outputs[..., :vocab] if outputs.ndim and outputs.shape[-1] > vocab else outputs


_TRACE_ERRORS = (TypeError, ValueError, IndexError)
"""What jax raises, while tracing, for inputs of a shape or type a model cannot take (and a
model's own refusal: `ZooError` is a `ValueError`)."""
_NOT_NUMBERS = {"U": "strings", "S": "bytes", "O": "Python objects", "c": "complex numbers"}


@dataclasses.dataclass(frozen=True)
class Reads:
    """What a model reads, as far as its hyper-parameters state it: images (or feature
    vectors) in floats, with the axes of `input_shape` (the size it was built for: a model
    that pools may take other sizes); or sequences of integer token ids, `context_length`
    long at most, each below `vocab_size`. Whatever they leave open is decided by tracing the
    model abstractly on the inputs (`jax.eval_shape`, nothing computed): what it cannot take
    fails there, before it runs. `column`: the batch column that holds them (the first its
    loss reads)."""

    model: str
    column: str
    data: str
    shape: tuple[int, ...] | None = None
    context_length: int | None = None
    vocab_size: int | None = None

    @classmethod
    def of(cls, config: DictConfig, hparams: Mapping[str, Any] | None = None) -> Reads:
        """What the model of `config` reads, its `hparams` those `config` resolves to unless
        given."""
        entry = registry.get_model(config.model.name)
        hparams = resolved_hparams(config) if hparams is None else hparams
        shape, length = hparams.get("input_shape"), hparams.get("context_length")
        return cls(
            entry.name,
            (entry.columns or ("inputs",))[0],
            str(config.data.name),
            tuple(shape) if shape else None,
            length if shape is None else None,
            hparams.get("vocab_size") if shape is None and length else None,
        )

    @property
    def states_nothing(self) -> bool:
        return self.shape is None and self.context_length is None

    def decides(self, array: np.ndarray) -> bool:
        """Whether what the model states shows that it takes `array` (checked by `check`)."""
        return self.context_length is not None or array.shape[1:] == self.shape

    def takes(self) -> str:
        """What the model takes, as a sentence."""
        if self.shape is not None:
            kind = "images" if len(self.shape) == 3 else "examples"
            return (
                f"Model '{self.model}' takes a batch (N, {', '.join(map(str, self.shape))}) of "
                f"float {kind} normalised as in training (its input_shape is "
                f"{list(self.shape)})."
            )
        if self.context_length is not None:
            vocabulary = f", each below vocab_size={self.vocab_size}" if self.vocab_size else ""
            return (
                f"Model '{self.model}' takes a batch (N, length) of integer token ids, length "
                f"at most context_length={self.context_length}{vocabulary}."
            )
        return (
            f"Model '{self.model}' takes a batch of examples shaped as the '{self.column}' "
            f"column of its training data (data set '{self.data}')."
        )

    def check(self, values: Any, what: str, examples: bool = False) -> np.ndarray:
        """`values` as an array of numbers with a batch axis, or a `ZooError` that begins with
        `what` ("predict got inputs") and says what they lack; for a model that states its
        inputs, everything those facts require of them. `examples`: `values` are the first
        examples of a data column, which names their shapes without the batch axis and may
        hold a token more than the model reads (the next-token target)."""
        array = numeric_batch(values, what, self.takes())
        if not examples:
            self._check_batch_axis(array, what)
        shape = f"of shape {array.shape[1:] if examples else array.shape} ({array.dtype})"
        if self.shape is not None and array.ndim != len(self.shape) + 1:
            raise ZooError(f"{what} {shape}. {self.takes()}{self.hint()}")
        if self.shape is not None and not jnp.issubdtype(array.dtype, jnp.floating):
            how = (
                f'zoo.load_data("{self.data}").transform({{"image": images}})["image"]'
                if self.data in registry.list_datasets()
                else "the transform its training data had"
            )
            raise ZooError(
                f"{what} {shape}: {array.dtype} images; model '{self.model}' takes float "
                f"images normalised as in training. Normalise them first: {how}."
            )
        if self.context_length is not None:
            self._check_tokens(array, f"{what} {shape}", examples)
        return array

    def _check_batch_axis(self, array: np.ndarray, what: str) -> None:
        if self.shape is not None and array.shape == self.shape:
            noun = "image" if len(self.shape) == 3 else "example"
        elif self.context_length is not None and array.ndim == 1:
            noun = "sequence"
        else:
            return
        raise ZooError(
            f"{what}: one {noun} of shape {array.shape}, without the batch axis; add it "
            f"(inputs[None], shape (1, {', '.join(map(str, array.shape))})). {self.takes()}"
        )

    def _check_tokens(self, array: np.ndarray, what: str, examples: bool) -> None:
        if array.ndim != 2 or array.shape[1] > self.context_length + examples:
            raise ZooError(f"{what}. {self.takes()}")
        if not jnp.issubdtype(array.dtype, jnp.integer):
            raise ZooError(
                f"{what}: not token ids. {self.takes()} Convert them, e.g. tokens.astype(np.int32)."
            )
        high = self.vocab_size
        outside = array[(array < 0) | (array >= high)] if high else array[array < 0]
        if outside.size:
            raise ZooError(
                f"{what}, holding token id {outside.flat[0]}, outside the vocabulary. "
                f"{self.takes()}"
            )

    def check_traced(
        self, graphdef: nnx.GraphDef, state: nnx.State, array: np.ndarray, what: str
    ) -> None:
        """The model (`graphdef`, `state`) traced abstractly on a batch of `array`'s shape and
        on one of another size: each output's leading axis is the batch's. Otherwise a
        `ZooError`: one example without its batch axis (if `array[None]` would do), or a shape
        the model cannot take."""

        def call(state: nnx.State, inputs: jax.Array) -> Any:
            return nnx.merge(graphdef, state)(inputs)

        def maps_batches(shape: tuple[int, ...]) -> str | None:
            """None if the model takes a batch of `shape`; else why not."""
            try:
                with sharding.unsplit_batch():
                    for size in (shape[0], shape[0] + 1):
                        abstract = jax.ShapeDtypeStruct((size, *shape[1:]), array.dtype)
                        outputs = jax.eval_shape(call, state, abstract)
                        if any(np.shape(o)[:1] != (size,) for o in jax.tree.leaves(outputs)):
                            return "its outputs do not have the batch's leading axis"
            except _TRACE_ERRORS as e:  # jax's error, or the model's own refusal
                return _reason(e)
            return None

        reason = maps_batches(array.shape)
        if reason is None:
            return
        if self.states_nothing and maps_batches((1, *array.shape)) is None:
            raise ZooError(
                f"{what}: one example of shape {array.shape}, without the batch axis; add it "
                f"(inputs[None], shape (1, {', '.join(map(str, array.shape))})). "
                f"{self.takes()}"
            )
        raise ZooError(
            f"{what} of shape {array.shape} ({array.dtype}), which model '{self.model}' cannot "
            f"take: {reason}. {self.takes()}{self.hint()}"
        )

    def hint(self) -> str:
        """What to do about images of another shape (nothing for other inputs)."""
        if self.shape is None or len(self.shape) != 3:
            return ""
        return (
            " Add a missing channel axis with images[..., None], and resize images of another size."
        )


def numeric_batch(values: Any, what: str, takes: str) -> np.ndarray:
    """`values` as one array of numbers with a batch axis, or a `ZooError` naming what it is."""
    try:
        array = np.asarray(values)
    except ValueError as e:  # rows of different lengths
        raise ZooError(
            f"{what} that do not make one array ({_reason(e)}). {takes} Pass one array whose "
            "examples all have one shape."
        ) from None
    kind = _NOT_NUMBERS.get(array.dtype.kind)
    if kind is not None or not (array.dtype == bool or jnp.issubdtype(array.dtype, jnp.number)):
        raise ZooError(
            f"{what} of {kind or array.dtype.name} (dtype {array.dtype}), which a model cannot "
            f"compute with. {takes} Convert or encode them as numbers first."
        )
    if array.ndim == 0:
        raise ZooError(f"{what} of one number ({array}), not a batch. {takes}")
    return array


def evaluate(
    trained: Trained,
    data: str | registry.Splits | Mapping[str, np.ndarray] | pipeline.RandomAccess,
    batch_size: int | None = None,
) -> dict[str, float]:
    """The model's eval metrics (its loss and metrics, each example counted once) on a
    registered data set's eval split, the eval split of `Splits` (with its `transform`), or
    columns / a random-access source as the model takes them. Data the model cannot read (a
    column missing or misnamed, strings, examples of a shape it cannot take) is refused by
    name before the model runs."""
    config = trained.config
    transform = None
    if isinstance(data, str):
        data = registry.get_data(data).splits({})
    if isinstance(data, registry.Splits):
        data, transform = data.eval, data.transform
    entry = registry.get_model(config.model.name)
    shards = sharding.batch_divisor(trained.mesh, trained.rules)
    size = batch_size or -(-int(config.trainer.batch_size) // shards) * shards
    check_columns(config, resolved_hparams(config), "eval", data, transform)
    batches = pipeline.eval_batches(data, size, transform=transform)
    graphdef, state = nnx.split((trained.model, None))
    eval_step = make_eval_step(graphdef, entry.loss)
    key = eval_key(int(config.seed))

    def step(state: Any, batch: Mapping[str, jax.Array]) -> Any:
        return eval_step(state, {}, batch, key)

    with trained.activate():
        first = sharding.shard_batch(batches[0], trained.mesh, trained.rules)
        _check_loss_traced(step, state, first, "eval", Reads.of(config))
    return evaluate_batches(eval_step, state, batches, trained.mesh, trained.rules, key)


def check_columns(
    config: DictConfig, hparams: Mapping[str, Any], split: str, data: Any, transform: Any
) -> None:
    """One split of the caller's data (columns, or a random-access source) for the model of
    `config` (of `hparams`): every column a batch of examples, the columns its loss reads
    present, labels within its classes, and its first example, as the model sees it
    (transformed), numbers of the kind it takes (`Reads`). Else a `ZooError` naming what is
    wrong."""
    if isinstance(data, Mapping):
        for name, column in data.items():
            if np.ndim(column) == 0:
                raise ZooError(
                    f"The {split} data's column '{name}' holds one value ({column!r}), not a "
                    "batch: each column holds one row per example, e.g. a (N, ...) array."
                )
    entry = registry.get_model(config.model.name)
    check_split(entry, split, data, hparams)
    first = pipeline.eval_batches(data, 1)[0]
    try:
        first = {**first, **transform(first)} if transform is not None else first
    except ZooError:
        raise
    except (TypeError, ValueError) as e:  # the caller's transform
        raise ZooError(
            f"The {split} data's transform fails on its first example: {type(e).__name__}: "
            f"{_reason(e)}."
        ) from None
    reads = Reads.of(config, hparams)
    for name in entry.columns or ():
        what = f"The {split} data's '{name}' column holds examples"
        if name == reads.column:
            reads.check(first[name], what, examples=True)
        else:
            numeric_batch(first[name], what, f"Model '{entry.name}' reads it as numbers.")


def check_data(config: DictConfig, splits: registry.Splits) -> None:
    """The caller's data for a run of `config` (`zoo.finetune(..., data=Splits)`), its model
    as `config.model` gives it (no data set decides anything): both splits as `check_columns`
    checks them, and, for a model that states nothing of its inputs, its loss traced
    abstractly on the first training example, before anything is built."""
    hparams = OmegaConf.to_container(config.model)
    for split, data in (("train", splits.train), ("eval", splits.eval)):
        check_columns(config, hparams, split, data, splits.transform)
    reads = Reads.of(config, hparams)
    if not reads.states_nothing:
        return
    entry = registry.get_model(config.model.name)
    mesh, rules = sharding.mesh_and_rules(checked_dict(MeshConfig, {}, "mesh"), jax.devices()[:1])
    first = pipeline.eval_batches(splits.train, 1, transform=splits.transform)[0]
    with sharding.activate(mesh, rules):
        graphdef, state = nnx.split(abstract_model(entry, hparams, 0))

        def loss(state, batch):
            return entry.loss(nnx.merge(graphdef, state), batch, nnx.Rngs(0))

        _check_loss_traced(loss, state, first, "train", reads)


def _check_loss_traced(
    loss: Any, state: Any, batch: Mapping[str, Any], split: str, reads: Reads
) -> None:
    """`loss(state, batch)` traced abstractly (nothing computed); what the model cannot take
    (jax's error, or the model's own refusal), a `ZooError` naming the batch's columns."""
    try:
        jax.eval_shape(loss, state, batch)
    except _TRACE_ERRORS as e:
        columns = ", ".join(
            f"'{name}' of shape {tuple(np.shape(column))[1:]} ({column.dtype})"
            for name, column in batch.items()
            if name != pipeline.MASK
        )
        raise ZooError(
            f"Model '{reads.model}' cannot read the {split} data's examples ({columns}): "
            f"{_reason(e)}. {reads.takes()}{reads.hint()}"
        ) from None


def _reason(error: Exception) -> str:
    """An error raised while tracing, as a clause of a sentence."""
    return str(error).strip().splitlines()[0].rstrip(".")


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
    `zoo.engine.sharding.mesh.activate(...)` (or use the trainer), since explicit sharding needs a mesh.
    """
    entry = registry.get_model(name)
    hparams = checked_params(f"model '{name}'", entry.config, overrides)
    hparams = entry.resolve(hparams, registry.get_data(data or entry.default_data))
    device_mesh, rules = sharding.mesh_and_rules(
        checked_dict(MeshConfig, dict(mesh or {}), "mesh"), devices
    )
    return build_on_mesh(entry, hparams, seed, device_mesh, rules).model

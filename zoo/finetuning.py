"""Fine-tuning through the Python API: `zoo.finetune(start, ...)` as one more run of the trainer.

A fine-tune is an ordinary run whose config's `finetune` section says where it started and what
it changes (a new head, frozen params, LoRA adapters): `zoo.load` rebuilds its model from that
config alone, and calling `finetune` again with the same arguments and workdir resumes it
exactly, as the CLI's resume does.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from zoo.data.conversations import write_conversations
from zoo.engine import registry, weights
from zoo.engine.checkpoints import locate
from zoo.engine.errors import ZooError
from zoo.engine.loop import RunLog, RunResult, Trainer
from zoo.engine.posttraining import DPO, GRPO, python_name
from zoo.engine.weights import Filter
from zoo.hub import local
from zoo.inputs import check_data
from zoo.lm_evaluation import lm_eval_callbacks
from zoo.loading import saved_config
from zoo.overrides import composed
from zoo.pretrained import is_pretrained_dir, run_tokenizer
from zoo.trained import Trained, TrainedModel, resolved_hparams
from zoo.training import console_logging

CHAT = "chat"
"""The data set that reads conversations given to `finetune` (files or a list)."""
PREFERENCE, PROMPTS = "preference", "prompts"
"""The data sets that read the preference pairs and the prompts given to `finetune(...,
method="dpo")` and `finetune(..., method="grpo")`."""
USER_DATA = "user"
"""`data.name` in the config of a run on the caller's own data (`finetune(..., data=Splits)`)."""


PYTHON_NAMES = (
    ("finetune.reinit=[head]", "replace_head=True"),
    ("in finetune.reinit,", "in reinit,"),
    ("finetune.reinit=", "reinit="),
    ("finetune.freeze=", "freeze="),
    ("finetune.lora_layers=", "lora_layers="),
    ("finetune.lora_rank=", "lora_rank="),
    ("finetune.quantize=", "quantize="),
    ("finetune.init_step=", "step="),
    ("finetune.method=", "method="),
)
"""How messages written for the command line name `finetune`'s keyword arguments: the
settings they suggest (`finetune.reinit=[head]`), not the config keys they list."""


def python_names_in_errors(function: Callable[..., RunResult]) -> Callable[..., RunResult]:
    """`function`, its errors speaking of `finetune`'s keyword arguments (`replace_head=True`)
    where they would name the command line's keys (`finetune.reinit=[head]`)."""

    @functools.wraps(function)
    def wrapped(*args: Any, **kwargs: Any) -> RunResult:
        try:
            return function(*args, **kwargs)
        except ZooError as e:
            raise ZooError(python_names(str(e))) from None

    return wrapped


def python_names(message: str) -> str:
    """A message for the command line, with `finetune`'s keyword arguments for its keys."""
    for cli, python in PYTHON_NAMES:
        message = message.replace(cli, python)
    return message


@python_names_in_errors
def finetune(
    start: str | os.PathLike | Trained,
    *overrides: str,
    data: str | os.PathLike | registry.Splits | Sequence[Any] | None = None,
    step: str | int | None = None,
    num_classes: int | None = None,
    replace_head: bool = False,
    reinit: tuple[str, ...] = (),
    freeze: str | Filter | None = None,
    lora_rank: int = 0,
    lora_layers: str = ".*",
    quantize: str | None = None,
    method: str | None = None,
    rewards: Sequence[Callable[..., Sequence[Any]]] = (),
    callbacks: Sequence[Any] = (),
) -> RunResult:
    """Fine-tune a trained model (or train a fresh one) with the trainer, as one more run.

    - `start`: the workdir of a run, a `RunResult` or `TrainedModel` (its weights at its step),
      a pretrained checkpoint directory (its family's model, sizes and tokenizer; see
      `zoo.list_models(families=True)`) or a Hugging Face Hub name (`hf://ORG/NAME`, see
      `zoo.hub`), or a registered model's name (fresh weights; its
      `model.*` keys from `overrides`).
    - `overrides`: the CLI's keys, e.g. `"trainer.steps=200"` (or `"trainer.epochs=3"`),
      `"optimizer.learning_rate=1e-3"`, `"workdir=runs/ft"`, `"mesh.fsdp=2"`; the model's own
      defaults fill the rest, but for the optimizer of a pretrained checkpoint's fine-tune
      (the defaults of its kind, LoRA or full: `zoo.defaults.fit_finetune_defaults`).
    - `data`: a registered data set's name (its `input_shape` and `num_classes` then decide the
      model's; `"data=NAME"` among the overrides says the same), or `zoo.Splits` of your own: columns of arrays or random-access sources (a Grain
      `MapDataset`, ...), batched, sharded and shuffled as the zoo's own data are; an `image`
      column decides `input_shape` (a fresh model on your own data needs `num_classes`).
      Conversations for a chat checkpoint: a path of JSON Lines or Parquet files, or a list of
      conversations (each a list of `{"role", "content"}` messages, or a dict with `messages`,
      or `prompt` and `completion`), read as `data=chat` reads them (`"data.loss_on=..."` and
      its other keys among the overrides).
      Default: the start run's data set.
    - `step`: which of the start run's checkpoints (`latest`, `best`, a step number).
    - `num_classes`: a new number of classes; with `replace_head` the head starts fresh
      (`reinit` names other params to start fresh). A param whose shape differs from the
      checkpoint's and that is not named so is an error.
    - `freeze`: params that get no gradient and no optimizer state: a path pattern, `backbone`
      (every param outside the head), or an NNX filter.
    - `lora_rank` > 0: add LoRA adapters to the Linear layers `lora_layers` matches and train
      only them and the fresh params; `zoo.merge_lora` folds them in afterwards.
    - `quantize` (`"int8"`, `"int4"` or `"nf4"`, with `lora_rank`): QLoRA, the adapted layers'
      base kernels held quantized and frozen (`finetune.quantize`).
    - `method`: what the fine-tune learns from (`finetune.method`): `"sft"` (the default),
      the data's own targets; `"dpo"`, preference pairs (`data`: files or a list of pairs,
      read as `data=preference` reads them), by the loss `"finetune.dpo.loss_type=..."`
      among the overrides names; `"grpo"`, the rewards of completions the model samples of
      prompts (`data`: files or a list of rows, read as `data=prompts` reads them).
    - `rewards`: `grpo`'s reward functions given as Python callables,
      `fn(prompts, completions, **columns) -> list[float | None]`, besides those
      `"finetune.grpo.rewards=[...]"` names (see "Preference and reward fine-tuning").
    - `callbacks`: objects with hooks the run calls (see `zoo.fit`); the `lm_eval` section's
      (`"lm_eval.tasks=[...]"` among the overrides) runs after them.

    Running the same call again with the same workdir resumes it (a finished run returns at
    once), as the CLI does. It prints and writes what the CLI does (`train.log`, `.hydra/`)."""
    with console_logging(), RunLog() as run_log:
        named = [o.partition("=")[2] for o in overrides if o.startswith("finetune.method=")]
        data, overrides = _conversations(
            *_named_data(data, overrides), method or next(reversed(named), None)
        )
        named_model = [o.partition("=")[2] for o in overrides if o.startswith("model=")]
        origin = _origin(start, step, next(reversed(named_model), None))
        overrides, base = (*origin.init_from, *overrides), origin.config
        if base is not None and data is None and base.data.name not in registry.list_datasets():
            raise ZooError(
                f"The run in {origin.workdir} trained on data of its own ('{base.data.name}'): "
                "pass the data to fine-tune on as data=zoo.Splits(...) or a registered data "
                "set's name."
            )
        user_data = isinstance(data, registry.Splits)
        if user_data:
            _check_image_axes(data, origin.name, base)
        cfg = composed(
            [*_model_args(origin.name, base, data, num_classes, overrides), *overrides],
            finetune=_settings(origin, reinit, freeze, lora_rank, lora_layers, quantize, method),
            train=data.train if user_data else None,
        )
        if replace_head:
            cfg.finetune.reinit.append(cfg.finetune.head)
        if freeze is not None and not isinstance(freeze, str):
            cfg.finetune.freeze = repr(freeze)  # a filter is code: the config records what it is
        if user_data:
            check_data(cfg, data)
            cfg = _on_user_data(cfg, data)
        frozen = None if freeze is None or isinstance(freeze, str) else freeze
        if rewards:
            given = [python_name(function) for function in rewards]
            cfg.finetune.grpo.rewards = [*cfg.finetune.grpo.rewards, *given]
        trainer = Trainer(
            cfg,
            data=data if user_data else None,
            freeze=frozen,
            callbacks=[*callbacks, *lm_eval_callbacks(cfg)],
            rewards=rewards,
        )
        return trainer.fit(overrides=list(overrides), run_log=run_log)


@dataclasses.dataclass(frozen=True)
class _Origin:
    """Where a fine-tune starts: its model's name and, for a run, its workdir, step and config;
    for a pretrained directory, the override that names it."""

    name: str
    workdir: str | None = None
    step: int | None = None
    config: DictConfig | None = None
    init_from: tuple[str, ...] = ()


def _origin(start: Any, step: str | int | None, model: str | None = None) -> _Origin:
    """What `start` is: a pretrained directory (or hub name; read as `model`'s, when the
    overrides name one), a run, or a registered model's name (a fresh one)."""
    pretrained = _pretrained(start, step, model)
    if pretrained is not None:
        named = f"finetune.init_from={pretrained.directory}"
        return _Origin(pretrained.family.model, init_from=(named,))
    workdir, step_number, base = _start(start, step)
    return _Origin(base.model.name if base is not None else str(start), workdir, step_number, base)


def _named_data(data: Any, overrides: tuple[str, ...]) -> tuple[Any, tuple[str, ...]]:
    """`data=NAME` among the overrides, as on the command line, taken as `data` where that is
    not given."""
    named = [o for o in overrides if o.startswith("data=")]
    if not named or data is not None:
        return data, overrides
    return named[-1].partition("=")[2], tuple(o for o in overrides if o not in named)


def _settings(
    origin: _Origin,
    reinit: tuple[str, ...],
    freeze: str | Filter | None,
    lora_rank: int,
    lora_layers: str,
    quantize: str | None,
    method: str | None,
) -> dict[str, Any]:
    """The config's `finetune` section as `finetune`'s keyword arguments set it (a `freeze`
    filter is code, set after composition)."""
    settings = {
        "reinit": list(reinit),
        "freeze": freeze if isinstance(freeze, str) else None,
        "lora_rank": lora_rank,
        "lora_layers": lora_layers,
    }
    if method is not None:
        settings["method"] = method
    if origin.workdir is not None:
        settings.update(init_from=origin.workdir, init_step=str(origin.step))
    if quantize is not None:
        settings["quantize"] = quantize
    return settings


def _conversations(
    data: Any, overrides: tuple[str, ...], method: str
) -> tuple[Any, tuple[str, ...]]:
    """`data` naming conversation files (a path, not a registered data set's name) or holding
    conversations (a list, written to the data cache as JSON Lines): the `chat` data set
    reading them, or `preference` for a preference method's pairs; any other `data` as it
    is."""
    if isinstance(data, list | tuple):
        path = write_conversations(data)
    elif isinstance(data, os.PathLike) or (
        isinstance(data, str) and data not in registry.list_datasets() and os.path.exists(data)
    ):
        path = data
    else:
        return data, overrides
    reader = {DPO: PREFERENCE, GRPO: PROMPTS}.get(method, CHAT)
    return reader, (f"data.path={json.dumps(os.path.abspath(path))}", *overrides)


def _check_image_axes(data: registry.Splits, name: str, base: DictConfig | None) -> None:
    """Images with as many axes as the model takes (height, width, channels): a missing
    channel axis would otherwise fail deep inside the first step."""
    shape = _user_data_facts(data).get("input_shape")
    entry = registry.get_model(name)
    model_shape = (
        resolved_hparams(base).get("input_shape")
        if base is not None
        else registry.get_data(entry.default_data).info.get("input_shape")
    )
    if shape is not None and model_shape is not None and len(shape) != len(model_shape):
        raise ZooError(
            f"The 'image' column holds images of shape {tuple(shape)}; model '{name}' takes "
            f"images with {len(model_shape)} axes, like its input_shape {list(model_shape)} "
            "(height, width, channels), each column batched as (N, height, width, channels). "
            "Add the missing channel axis, e.g. images[..., None]."
        )


def _model_args(
    name: str,
    base: DictConfig | None,
    data: str | registry.Splits | None,
    num_classes: int | None,
    overrides: tuple[str, ...],
) -> list[str]:
    """The overrides that choose the model and its data set: the start run's model sizes, less
    what the fine-tune's data decides and what `overrides` set themselves."""
    args = [f"model={name}"]
    data_name = data if isinstance(data, str) else base.data.name if base is not None else None
    if data_name is not None and data_name in registry.list_datasets():
        args.append(f"data={data_name}")
    user_data = isinstance(data, registry.Splits)
    given = {o.split("=")[0].lstrip("+~") for o in overrides}
    if base is not None and data_name == base.data.name and not user_data:
        # the same data set, read as the start run read it (its window, its normalisation)
        for key, value in OmegaConf.to_container(base.data).items():
            if key != "name" and f"data.{key}" not in given:
                args.append(f"data.{key}={json.dumps(value)}")
    if num_classes is not None:
        given.add("model.num_classes")
    if base is not None:
        decided = _data_decides(data, user_data)
        for key, value in resolved_hparams(base).items():
            if key != "name" and key not in decided and f"model.{key}" not in given:
                args.append(f"model.{key}={json.dumps(value)}")
    if user_data:
        args += [f"model.{k}={json.dumps(v)}" for k, v in _user_data_facts(data).items()]
    if num_classes is not None:
        args.append(f"model.num_classes={num_classes}")
    return args


def _pretrained(
    start: Any, step: str | int | None, model: str | None = None
) -> weights.Pretrained | None:
    """The pretrained checkpoint directory `start` names, if it is one (not a run's workdir);
    an `hf://` name is resolved to its directory in the hub's cache (see `zoo.hub`)."""
    start = local(start)
    if not isinstance(start, str | os.PathLike) or not is_pretrained_dir(start):
        return None
    if step is not None:
        raise ZooError(
            f"The pretrained directory {start} holds one set of weights: step={step!r} is not "
            "for it."
        )
    return weights.open_pretrained(start, model)


def _start(start: Any, step: str | int | None) -> tuple[str | None, int | None, DictConfig | None]:
    """(workdir, step, its config) of the run a fine-tune starts from; Nones for a fresh one.
    The config's tokenizer is the run's own copy where the file it names is gone (see
    `zoo.pretrained.run_tokenizer`), so that the fine-tune reads the ids the run read."""
    if isinstance(start, RunResult | TrainedModel):
        workdir, which = start.workdir, start.step if step is None else step
    elif isinstance(start, str) and start in registry.list_models():
        if step is not None:
            raise ZooError(f"A fresh '{start}' has no checkpoints: step={step!r} is not for it.")
        return None, None, None
    else:
        workdir, which = os.fspath(start), "latest" if step is None else step
    step_number, path = locate(workdir, which)
    config = saved_config(path)
    if config.data.get("tokenizer"):
        config.data.tokenizer = run_tokenizer(config, workdir)
    return os.path.abspath(workdir), step_number, config


def _data_decides(data: Any, user_data: bool) -> set[str]:
    """The model parameters that the fine-tune's data decides instead of the start run."""
    if isinstance(data, str):
        return registry.get_data(data).decides
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

"""Checks of a composed run config that its types alone cannot express: keys that no schema
has, ranges, cadences, meshes and rules, fine-tuning patterns.

One function, `validate`, for every way a config enters: the command line and the Python API
call it after composing, so a bad value is refused with one paragraph before anything runs.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf
from zoo.engine import registry
from zoo.engine.config import Config, LMEvalConfig, resume_step
from zoo.engine.errors import ZooError
from zoo.engine.loop.dispatch import check_cadences
from zoo.engine.pipeline.batches import ExampleSource
from zoo.engine.posttraining import (
    ADAPTERS,
    COPY,
    DPO,
    GRPO,
    GRPOOptions,
    PreferenceOptions,
    grpo_options,
    method_of,
    preference_options,
    reference_source,
)
from zoo.engine.sharding.mesh import AxisRules, check_mesh_sizes
from zoo.engine.weights.lora import check_unstacked
from zoo.engine.weights.quantize import FORMATS


def validate(cfg: DictConfig) -> None:
    """Raise `ZooError` naming the first key whose value cannot run."""
    check_keys(cfg)
    if not str(cfg.workdir).strip():
        raise ZooError(
            "workdir is empty: name the directory the run writes into, e.g. workdir=runs/a."
        )
    check_trainer(cfg.trainer)
    for key in ("histogram_every", "norms_every"):
        if cfg.logging[key] < 0:
            raise ZooError(f"logging.{key}={cfg.logging[key]} must be 0 (off) or positive.")
    check_mesh_sizes(cfg.mesh)
    if cfg.mesh.cpu_devices < 0:
        raise ZooError(
            f"mesh.cpu_devices={cfg.mesh.cpu_devices} must be 0 (the platform's devices) or a "
            "number of simulated CPU devices."
        )
    AxisRules.from_mapping(cfg.mesh.rules)
    check_optimizer(cfg.optimizer, cfg.trainer.steps)
    check_finetune(cfg.finetune)
    check_grpo_trainer(cfg.trainer, cfg.finetune)
    check_reference_copy(cfg.trainer, cfg.finetune)
    check_unstacked(cfg.finetune, cfg.model)
    check_distributed(cfg.distributed)
    check_lm_eval(cfg.lm_eval, cfg.trainer)


def check_keys(cfg: DictConfig) -> None:
    """Hydra's `+key=value` adds keys even to typed nodes: reject any key that no schema has,
    with the chosen model's and data set's own schemas standing in for `model` and `data`."""
    schemas = {
        "model": registry.get_model(cfg.model.name).config,
        "data": registry.get_data(cfg.data.name).config,
    }
    for path, schema in _unknown_keys(OmegaConf.to_container(cfg), Config, "", schemas):
        parent = path.rpartition(".")[0]
        where = f"'{parent}'" if parent else "the top level"
        raise ZooError(
            f"Unknown config key '{path}'. Valid keys at {where}: "
            f"{', '.join(f.name for f in dataclasses.fields(schema))}."
        )


def _unknown_keys(
    node: Mapping[str, Any], schema: type, path: str, overrides: Mapping[str, type]
) -> Iterator[tuple[str, type]]:
    hints = typing.get_type_hints(schema)
    for key, value in node.items():
        child = overrides.get(f"{path}{key}", hints.get(key))
        if key not in hints:
            yield f"{path}{key}", schema
        elif dataclasses.is_dataclass(child) and isinstance(value, Mapping):
            yield from _unknown_keys(value, child, f"{path}{key}.", overrides)


def check_trainer(trainer: Any) -> None:
    for key in ("steps", "batch_size", "log_every"):
        if trainer[key] < 1:
            raise ZooError(f"trainer.{key}={trainer[key]} must be at least 1.")
    if trainer.epochs is not None and trainer.epochs < 1:
        raise ZooError(
            f"trainer.epochs={trainer.epochs} must be at least 1, or null (train trainer.steps)."
        )
    if trainer.grad_accum_steps < 1:
        raise ZooError(
            f"trainer.grad_accum_steps={trainer.grad_accum_steps} must be at least 1 (1: the "
            "whole batch at once)."
        )
    for key in ("eval_every", "checkpoint_every"):
        if trainer[key] < 0:
            raise ZooError(f"trainer.{key}={trainer[key]} must be 0 (off) or positive.")
    check_cadences(trainer)
    _check_early_stop(trainer)
    if trainer.keep < 1:
        raise ZooError(
            f"trainer.keep={trainer.keep} must be at least 1: the latest checkpoint is always kept."
        )
    _check_profile_steps(list(trainer.profile_steps), trainer.steps)
    if resume_step(trainer.resume) is None and trainer.resume not in ("auto", "never"):
        raise ZooError(
            f"trainer.resume={trainer.resume} must be 'auto', 'never' or a step number (an "
            "integer >= 0)."
        )


def check_optimizer(optimizer: Any, steps: int) -> None:
    _in_range("optimizer.learning_rate", optimizer.learning_rate, "a positive number", low=0)
    _in_range("optimizer.final_lr_fraction", optimizer.final_lr_fraction, "between 0 and 1", 0, 1)
    _in_range("optimizer.momentum", optimizer.momentum, "between 0 (plain SGD) and 1", 0, 1)
    _in_range("optimizer.weight_decay", optimizer.weight_decay, "0 or positive", 0)
    if optimizer.grad_clip_norm is not None:
        _in_range("optimizer.grad_clip_norm", optimizer.grad_clip_norm, "positive (or null)", 0)
    for key in ("learning_rate", "grad_clip_norm"):
        if optimizer[key] == 0:
            raise ZooError(f"optimizer.{key}=0 must be positive.")
    if optimizer.ema_decay is not None and not 0 < optimizer.ema_decay < 1:
        raise ZooError(
            f"optimizer.ema_decay={optimizer.ema_decay} must lie strictly between 0 and 1 "
            "(e.g. 0.999), or be null (no average)."
        )
    if optimizer.momentum == 1:
        raise ZooError("optimizer.momentum=1 must be below 1: the update would never decay.")
    if not 0 <= optimizer.warmup_steps <= steps:
        raise ZooError(
            f"optimizer.warmup_steps={optimizer.warmup_steps} must lie between 0 and "
            f"trainer.steps={steps}."
        )


def _in_range(key: str, value: float, valid: str, low: float, high: float = math.inf) -> None:
    """`low <= value <= high`, and a finite number."""
    if not (math.isfinite(value) and low <= value <= high):
        raise ZooError(f"{key}={value} must be {valid}.")


def check_distributed(distributed: Any) -> None:
    if distributed.heartbeat_timeout < 1:
        raise ZooError(
            f"distributed.heartbeat_timeout={distributed.heartbeat_timeout} must be at least 1 "
            "(seconds)."
        )
    count, index = distributed.num_processes, distributed.process_id
    if count is not None and count < 1:
        raise ZooError(f"distributed.num_processes={count} must be at least 1.")
    if index is not None and (index < 0 or (count is not None and index >= count)):
        raise ZooError(
            f"distributed.process_id={index} must lie between 0 and num_processes - 1"
            f"{f' = {count - 1}' if count else ''}."
        )


def check_finetune(finetune: Any) -> None:
    """Range and syntax checks of the `finetune` section."""
    if finetune.lora_rank < 0:
        raise ZooError(f"finetune.lora_rank={finetune.lora_rank} must be 0 (off) or positive.")
    _check_quantize(finetune)
    _check_method(finetune)
    step = str(finetune.init_step)
    if resume_step(step) is None and step not in ("latest", "best"):
        raise ZooError(
            f"finetune.init_step={step} must be 'latest', 'best' or a step number (an integer "
            ">= 0)."
        )
    patterns = [*finetune.reinit, finetune.freeze, finetune.head, finetune.lora_layers]
    for pattern in filter(None, patterns):
        try:
            re.compile(pattern)
        except re.error as e:
            raise ZooError(f"The path pattern '{pattern}' is not a valid regex: {e}.") from None


def _check_quantize(finetune: Any) -> None:
    """`finetune.quantize`: a format qwix quantizes to, and only for the base of adapters."""
    qtype = finetune.quantize
    if qtype is None:
        return
    if qtype not in FORMATS:
        raise ZooError(
            f"finetune.quantize={qtype} is not a base-weight format: use one of "
            f"{', '.join(FORMATS)}, or null to keep the base weights as they are."
        )
    if finetune.lora_rank <= 0:
        raise ZooError(
            f"finetune.quantize={qtype} quantizes the base weights of LoRA adapters (QLoRA), "
            f"but finetune.lora_rank={finetune.lora_rank} adds none: set finetune.lora_rank "
            "to a positive rank (e.g. 16), or finetune.quantize=null."
        )


def _check_method(finetune: Any) -> None:
    """`finetune.dpo`'s or `finetune.grpo`'s options, and a reference model the run can
    compute."""
    _check_unused_sections(finetune)
    if method_of(finetune) == GRPO:
        _check_grpo(finetune)
    if method_of(finetune) != DPO:
        return
    options = preference_options(finetune)
    if options.uses_reference and options.reference == ADAPTERS and finetune.lora_rank <= 0:
        raise ZooError(
            f"finetune.dpo.loss_type={options.loss_type} compares the policy with a reference "
            f"model, which finetune.dpo.reference={options.reference} takes from the starting "
            "model with its LoRA adapters off, but finetune.lora_rank=0 adds none: set "
            "finetune.lora_rank to a positive rank (e.g. 16), or for a full fine-tune "
            "finetune.dpo.reference=precomputed (the starting model's log-probabilities, "
            "computed once before training) or copy (a frozen copy of its weights), or a "
            "reference-free loss (finetune.dpo.loss_type=simpo or orpo)."
        )


def _check_unused_sections(finetune: Any) -> None:
    """Refuse a setting of `finetune.dpo` or `finetune.grpo` that the run's method would not
    read, rather than train as if it were not there."""
    method = method_of(finetune)
    for section, owner, options in (("dpo", DPO, PreferenceOptions), ("grpo", GRPO, GRPOOptions)):
        if method == owner or section not in finetune:
            continue
        given = finetune[section]
        given = OmegaConf.to_container(given) if isinstance(given, DictConfig) else dict(given)
        defaults = dataclasses.asdict(options())
        changed = [
            f"finetune.{section}.{key}={given[key]}"
            for key in defaults
            if key in given and given[key] != defaults[key]
        ]
        if changed:
            raise ZooError(
                f"{', '.join(changed)} {'applies' if len(changed) == 1 else 'apply'} only to "
                f"finetune.method={owner}, and this run's is "
                f"finetune.method={method}: set finetune.method={owner}, or leave "
                f"finetune.{section} at its defaults."
            )


def _check_grpo(finetune: Any) -> None:
    """`finetune.grpo`'s options, and a reference for its KL penalty."""
    options = grpo_options(finetune)
    if options.beta and options.reference == ADAPTERS and finetune.lora_rank <= 0:
        raise ZooError(
            f"finetune.grpo.beta={options.beta} penalises the KL to the reference model, which "
            f"finetune.grpo.reference={options.reference} takes from the starting model with "
            "its LoRA adapters off, but finetune.lora_rank=0 adds none: set "
            "finetune.lora_rank to a positive rank (e.g. 16), or for a full fine-tune "
            "finetune.grpo.reference=copy (a frozen copy of the starting weights), or "
            "finetune.grpo.beta=0."
        )


def check_reference_copy(trainer: Any, finetune: Any) -> None:
    """`finetune.dpo.reference=copy` computes each batch's reference before its step: one
    step per dispatch."""
    if method_of(finetune) != DPO:  # grpo dispatches one step at a time: check_grpo_trainer
        return
    if reference_source(finetune) == COPY and trainer.steps_per_dispatch != 1:
        raise ZooError(
            f"trainer.steps_per_dispatch={trainer.steps_per_dispatch}: with "
            "finetune.dpo.reference=copy the frozen copy scores each batch before its step, "
            "one step per dispatch: use trainer.steps_per_dispatch=1, or "
            "finetune.dpo.reference=precomputed."
        )


def check_grpo_trainer(trainer: Any, finetune: Any) -> None:
    """The cadences a GRPO run can keep: one step per dispatch (each step's batch is sampled
    by the policy the step before left), checkpoints between batches of completions."""
    if method_of(finetune) != GRPO:
        return
    if trainer.steps_per_dispatch != 1:
        raise ZooError(
            f"trainer.steps_per_dispatch={trainer.steps_per_dispatch}: finetune.method=grpo "
            "samples each step's completions with the policy the step before left, so it "
            "dispatches one step at a time: use trainer.steps_per_dispatch=1."
        )
    iterations = grpo_options(finetune).num_iterations
    if trainer.checkpoint_every % iterations:
        raise ZooError(
            f"trainer.checkpoint_every={trainer.checkpoint_every} must be a multiple of "
            f"finetune.grpo.num_iterations={iterations}: a checkpoint falls between batches of "
            "completions, so that a resumed run samples the next one."
        )


def check_lm_eval(lm_eval: Any, trainer: Any) -> None:
    """The `lm_eval` section's values (the front checks the task names and the model, with
    lm-eval): its tasks run on checkpoints, so on a cadence the run saves them at."""
    if not lm_eval.tasks:
        _check_lm_eval_unused(lm_eval)
        return
    tasks = f"lm_eval.tasks=[{', '.join(lm_eval.tasks)}]"
    if not all(str(name).strip() for name in lm_eval.tasks):
        raise ZooError(f"{tasks} holds an empty name: name each task, e.g. [hellaswag].")
    every = trainer.checkpoint_every if lm_eval.every is None else lm_eval.every
    if trainer.checkpoint_every < 1:
        raise ZooError(
            f"{tasks} runs its tasks on the run's checkpoints, and trainer.checkpoint_every=0 "
            "saves one only after the last step: set trainer.checkpoint_every to a number of "
            "steps (e.g. 100) that divides lm_eval.every."
        )
    checkpoint, steps = trainer.checkpoint_every, trainer.steps
    if every < 1 or every % checkpoint or every > steps:
        shown = "null (every checkpoint)" if lm_eval.every is None else every
        example = f", e.g. lm_eval.every={checkpoint}" if checkpoint <= steps else ""
        raise ZooError(
            f"lm_eval.every={shown} must be a positive multiple of trainer.checkpoint_every="
            f"{checkpoint} (the tasks run on checkpoints) of at most trainer.steps={steps}"
            f"{example}."
        )
    _check_lm_eval_options(lm_eval)


def _check_lm_eval_options(lm_eval: Any) -> None:
    limit = lm_eval.limit
    if limit is not None and not (0 < limit < 1 or (limit >= 1 and limit == int(limit))):
        raise ZooError(
            f"lm_eval.limit={limit} must be a number of documents (a whole number, e.g. 100), "
            "a share of them below 1 (e.g. 0.1), or null (all)."
        )
    if lm_eval.num_fewshot is not None and lm_eval.num_fewshot < 0:
        raise ZooError(
            f"lm_eval.num_fewshot={lm_eval.num_fewshot} must be 0 or more examples, or null "
            "(the task's own)."
        )
    if lm_eval.batch_size < 1:
        raise ZooError(f"lm_eval.batch_size={lm_eval.batch_size} must be at least 1.")


def _check_lm_eval_unused(lm_eval: Any) -> None:
    """Refuse a setting of `lm_eval` when it names no task: nothing would read it."""
    given = OmegaConf.to_container(lm_eval) if isinstance(lm_eval, DictConfig) else dict(lm_eval)
    defaults = dataclasses.asdict(LMEvalConfig())
    changed = [f"lm_eval.{key}={given[key]}" for key in defaults if given[key] != defaults[key]]
    if changed:
        raise ZooError(
            f"{', '.join(changed)} {'applies' if len(changed) == 1 else 'apply'} to the tasks "
            "of lm_eval.tasks, which names none: name them (lm_eval.tasks=[hellaswag]), or "
            "leave lm_eval at its defaults."
        )


def _check_early_stop(trainer: Any) -> None:
    early = trainer.early_stop
    if early.patience < 1:
        raise ZooError(f"trainer.early_stop.patience={early.patience} must be at least 1 (evals).")
    _in_range("trainer.early_stop.min_delta", early.min_delta, "0 or positive", 0)
    if early.metric and not trainer.eval_every:
        raise ZooError(
            f"trainer.early_stop.metric={early.metric} needs evals to watch: set "
            "trainer.eval_every to a number of steps (it is 0: only after the last step)."
        )


def _check_profile_steps(steps: list[int], total: int) -> None:
    if not steps:
        return
    if len(steps) != 2 or not 1 <= steps[0] <= steps[1] <= total:
        raise ZooError(
            f"trainer.profile_steps={steps} must be [] (no trace) or [first, last], two steps "
            f"with 1 <= first <= last <= trainer.steps={total}, e.g. trainer.profile_steps=[10,20]."
        )


def check_data(entry: registry.ModelEntry, splits: registry.Splits, hparams: Mapping) -> None:
    """The caller's own data against the model: the columns its loss reads, and labels within
    its classes (checked on arrays; a random-access source is read as the run goes)."""
    for split, data in (("train", splits.train), ("eval", splits.eval)):
        check_split(entry, split, data, hparams)
    check_packing(entry, splits)


def check_split(entry: registry.ModelEntry, split: str, data: Any, hparams: Mapping) -> None:
    """One split of the caller's data (columns, a random-access source or an `ExampleSource`)
    against the model."""
    columns = _columns(data)
    missing = [c for c in entry.columns or () if c not in columns]
    if missing:
        raise ZooError(
            f"The {split} data has no column {', '.join(map(repr, missing))}: it has "
            f"{', '.join(map(repr, columns)) or 'none'}, and model '{entry.name}' reads "
            f"{', '.join(map(repr, entry.columns))}. Name the columns as the model reads "
            f"them. The columns each model reads: {columns_by_model()}."
        )
    classes = hparams.get("num_classes")
    if isinstance(data, Mapping) and "label" in data and isinstance(classes, int):
        _check_labels(split, np.asarray(data["label"]), classes, entry.name)


def check_packing(entry: registry.ModelEntry, splits: registry.Splits) -> None:
    """Refuse packed rows (a `SEGMENT_IDS` column) for a model that would let attention cross
    their sequences: only one whose class sets `PACKED_ROWS` keeps them apart."""
    if _packs(entry):
        return
    if registry.SEGMENT_IDS in _columns(splits.train) + _columns(splits.eval):
        takes = [n for n in registry.list_models() if _packs(registry.get_model(n))]
        raise ZooError(
            f"Model '{entry.name}' cannot take packed rows (data.packing=true, or a "
            f"'{registry.SEGMENT_IDS}' column): its attention would cross the sequences packed "
            f"into a row. Set data.packing=false, or use a model that takes them: "
            f"{', '.join(takes) or 'none registered'}."
        )


def _packs(entry: registry.ModelEntry) -> bool:
    return bool(getattr(entry.constructor, "PACKED_ROWS", False))


def columns_by_model() -> str:
    """`mlp, cnn, ...: image, label; gpt: tokens, length; ...`, from the registry."""
    families: dict[tuple[str, ...], list[str]] = {}
    for name in registry.list_models():
        columns = registry.get_model(name).columns
        if columns:
            families.setdefault(columns, []).append(name)
    return "; ".join(f"{', '.join(names)}: {', '.join(c)}" for c, names in families.items())


def _columns(data: Any) -> list[str]:
    if isinstance(data, Mapping):
        return list(data)
    if isinstance(data, ExampleSource):
        return list(data.examples(np.zeros(1, np.int64), None, 0)) if len(data) else []
    return list(data[0]) if len(data) else []


def _check_labels(split: str, labels: np.ndarray, classes: int, model: str) -> None:
    if not np.issubdtype(labels.dtype, np.integer):
        raise ZooError(
            f"The {split} data's 'label' column holds {labels.dtype} values: model '{model}' "
            f"takes integer class labels 0..{classes - 1}; convert it, e.g. "
            "labels.astype(np.int32)."
        )
    bad = np.unique(labels[(labels < 0) | (labels >= classes)])
    if bad.size:
        shown = ", ".join(map(str, bad[:10])) + (", ..." if bad.size > 10 else "")
        raise ZooError(
            f"The {split} data's 'label' column holds {shown}, outside the classes of model "
            f"'{model}': with num_classes={classes} a label must lie in 0..{classes - 1}. "
            "Relabel the data, or give the model more classes (num_classes=..., with "
            "replace_head=True when fine-tuning a trained head)."
        )

"""`zoo.evaluate_lm`: lm-evaluation-harness tasks (`lm-eval`, the extra `zoo[eval]`) run on a
language model of zoo through `zoo.lm_harness.ZooLM`; each task's metrics returned, written as
JSON and, for a run, to its TensorBoard (`lm_eval/<task>/<metric>` at the checkpoint's step).
The command line: `python -m zoo.eval` (`zoo/eval/`). During training: `LMEvalCallback`, which
a run config's `lm_eval` section adds (`lm_eval_callbacks`), checked at composition with the
rest of the config (`check_lm_eval`).

Tasks are the harness's own (`hellaswag`, `arc_easy`, ...; their data sets come from the
Hugging Face Hub) and those of the YAML files under `include` (a task over local files needs
no download). When every task named is one of `include`'s, the harness's own thousands are not
indexed (about ten seconds).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig
from tensorboardX import SummaryWriter

from zoo.engine import registry
from zoo.engine.errors import ZooError
from zoo.engine.loop import RunResult
from zoo.pretrained import is_pretrained_dir
from zoo.trained import TrainedModel

TAG = "lm_eval"
"""The TensorBoard tags' root: `lm_eval/<task>/<metric>`."""

log = logging.getLogger("zoo")


def evaluate_lm(
    model: str | os.PathLike | TrainedModel | RunResult,
    tasks: str | Sequence[str],
    *,
    num_fewshot: int | None = None,
    limit: float | None = None,
    batch_size: int = 8,
    max_length: int | None = None,
    include: str | os.PathLike | Sequence[str | os.PathLike] = (),
    output: str | os.PathLike | None = None,
    tensorboard: str | os.PathLike | bool | None = None,
    step: str | int = "latest",
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """Each task's metrics (`{"hellaswag": {"acc": 0.31, "acc_norm": ...}}`; a metric of a
    filter other than the task's plain one is `metric/filter`) for `model`: a run, a workdir (its
    checkpoint `step`), a pretrained directory or an `hf://` name.

    `tasks`: names, or one comma-separated string; `num_fewshot` examples before each question
    (default: the task's own); `limit` documents of each task (a count, or a fraction below 1);
    `batch_size` rows per forward pass; `max_length` tokens of context (default: the model's);
    `include`: folders of task YAML files; `output`: a JSON file to write (the metrics, and the
    harness's results, task configs and versions); `tensorboard`: the folder of the event file
    (default: the run's workdir for a run, none for a checkpoint directory; False: none);
    `seed` for tasks that sample and for the harness's few-shot draws."""
    harness = _harness()
    names = [t.strip() for t in tasks.split(",")] if isinstance(tasks, str) else list(tasks)
    folders = [include] if isinstance(include, str | os.PathLike) else list(include)
    manager = _task_manager(harness, [n for n in names if n], [str(f) for f in folders])
    lm = harness.ZooLM(model, batch_size, max_length, step=step, seed=seed)
    results = harness.simple_evaluate(
        model=lm,
        tasks=names,
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=manager,
        random_seed=seed,
        numpy_random_seed=seed,
        fewshot_random_seed=seed,
    )
    metrics = {task: _metrics(values) for task, values in results["results"].items()}
    if output is not None:
        _write_json(harness, Path(output), metrics, results, lm.trained)
    events = _events_dir(lm.trained, tensorboard)
    if events is not None:
        _write_events(events, metrics, lm.trained.step)
    return metrics


def _harness(user: str = "zoo.evaluate_lm and python -m zoo.eval run"):
    """`zoo.lm_harness` (and lm-eval beneath it), imported on first use: lm-eval is an extra,
    whose absence is said naming what needs it (`user`)."""
    try:
        harness = importlib.import_module("zoo.lm_harness")
    except ModuleNotFoundError as e:
        if e.name is None or not e.name.startswith("lm_eval"):
            raise
        raise ZooError(
            f"{user} lm-evaluation-harness, which is not installed: pip install 'zoo[eval]' "
            "(or lm-eval) first."
        ) from None
    return harness


def _task_manager(harness, names: list[str], include: list[str], prefix: str = ""):
    """The harness's task index: `include`'s tasks alone when they hold every name, else the
    harness's own besides; a name neither knows is refused with the likeliest meant, and so
    is a folder that is not one. `prefix`: the section of `include` in the messages (`lm_eval.`
    for a run's config)."""
    if not names:
        raise ZooError("tasks= names no task: give one or more, e.g. tasks=hellaswag,arc_easy.")
    for folder in include:
        if not os.path.isdir(folder):
            raise ZooError(f"{prefix}include={folder!r} is not a folder of task YAML files.")
    if include:
        local = harness.TaskManager(include_path=include, include_defaults=False)
        if not set(names) - set(local.all_tasks):
            return local
    manager = harness.TaskManager(include_path=include or None)
    unknown = [n for n in names if not manager.match_tasks([n])]
    if unknown:
        near = difflib.get_close_matches(unknown[0], manager.all_tasks, n=5)
        hint = f"; close names: {', '.join(near)}" if near else ""
        raise ZooError(
            f"lm-eval knows no task, group or tag named {', '.join(map(repr, unknown))}{hint}. "
            "Name one of the harness's tasks (lm-eval ls tasks lists them) or of the YAML files "
            f"in a folder given as {prefix}include."
        )
    return manager


def _metrics(values: dict[str, Any]) -> dict[str, float]:
    """A task's numeric metrics, `acc,none` as `acc` and `exact_match,strict-match` as
    `exact_match/strict-match`, their standard errors left to the JSON."""
    out = {}
    for key, value in values.items():
        metric, _, kind = key.partition(",")
        if not kind or "_stderr" in metric or not isinstance(value, int | float):
            continue
        out[metric if kind == "none" else f"{metric}/{kind}"] = float(value)
    return out


def _write_json(harness, path: Path, metrics: dict, results: dict, trained: Any) -> None:
    record = {
        "model": trained.workdir,
        "step": trained.step,
        "metrics": metrics,
        **{k: results[k] for k in ("results", "configs", "versions", "n-shot") if k in results},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=harness.handle_non_serializable) + "\n")


def _events_dir(trained: TrainedModel | RunResult, tensorboard: Any) -> str | None:
    if tensorboard is False:
        return None
    if tensorboard is None or tensorboard is True:
        return None if is_pretrained_dir(trained.workdir) else trained.workdir
    return os.fspath(tensorboard)


def _write_events(logdir: str | os.PathLike, metrics: dict[str, dict[str, float]], step: int):
    """Each metric as the scalar `lm_eval/<task>/<metric>` at `step` in an event file of
    `logdir` (a run's workdir: beside its training curves). NaN metrics are left out."""
    writer = SummaryWriter(logdir=os.path.abspath(logdir))
    try:
        for task, values in metrics.items():
            for metric, value in values.items():
                if not math.isnan(value):
                    writer.add_scalar(f"{TAG}/{task}/{metric}", value, step)
    finally:
        writer.close()


class LMEvalCallback:
    """A callback of `zoo.fit` (`callbacks=[LMEvalCallback("hellaswag", every=1000)]`): the
    tasks run on each checkpoint whose step is a multiple of `every`, once it is complete on
    disk, loaded from the run's workdir onto one device beside the training state;
    the metrics go to the run's TensorBoard at that step and into `results` (step -> metrics).
    `options`: `zoo.evaluate_lm`'s keyword arguments. Checkpoints come every
    `trainer.checkpoint_every` steps: `every` names which of them are evaluated. Each
    evaluation says its metrics in one console line."""

    def __init__(self, tasks: str | Sequence[str], every: int = 1, **options: Any):
        self.tasks, self.every, self.options = tasks, every, options
        self.results: dict[int, dict[str, dict[str, float]]] = {}

    def on_checkpoint(self, step: int, path: str) -> None:
        if step % self.every == 0:
            workdir = os.path.dirname(os.path.dirname(path))
            self.results[step] = evaluate_lm(workdir, self.tasks, step=step, **self.options)
            log.info("lm_eval at step %d: %s", step, _shown(self.results[step]))


def _shown(metrics: dict[str, dict[str, float]]) -> str:
    """`tiny_choice acc 0.25, acc_norm 0.5; arc_easy acc 0.61`: a console line's metrics."""
    return "; ".join(
        f"{task} " + ", ".join(f"{metric} {value:.4g}" for metric, value in values.items())
        for task, values in metrics.items()
    )


def check_lm_eval(cfg: DictConfig) -> None:
    """A run config's `lm_eval` section against what this process has, before anything is
    built: lm-eval installed, a language model to score, and tasks the harness (or a folder of
    `lm_eval.include`) knows by those names. The engine checks its values (`validate`)."""
    section = cfg.lm_eval
    if not section.tasks:
        return
    tasks = f"lm_eval.tasks=[{', '.join(section.tasks)}]"
    harness = _harness(f"{tasks} runs")
    if not _is_language_model(cfg.model.name):
        models = [name for name in registry.list_models() if _is_language_model(name)]
        raise ZooError(
            f"{tasks} scores a language model, and model '{cfg.model.name}' is not one: train "
            f"one of {', '.join(models)}, or leave lm_eval.tasks empty."
        )
    _task_manager(harness, list(section.tasks), list(section.include), prefix="lm_eval.")


def _is_language_model(name: str) -> bool:
    """Whether the registered model `name` is one that `ZooLM` scores, told from its entry
    before it is built: a vocabulary, a context length and decoding."""
    entry = registry.get_model(name)
    keys = {field.name for field in dataclasses.fields(entry.config)}
    return {"vocab_size", "context_length"} <= keys and hasattr(entry.constructor, "decode")


def lm_eval_callbacks(cfg: DictConfig) -> list[LMEvalCallback]:
    """The callback that a run config's `lm_eval` section asks for; none when it names no
    task. `lm_eval.every` null is every checkpoint of `trainer.checkpoint_every`."""
    section = cfg.lm_eval
    if not section.tasks:
        return []
    limit = section.limit
    options = {
        "include": list(section.include),
        "limit": int(limit) if limit is not None and limit >= 1 else limit,
        "num_fewshot": section.num_fewshot,
        "batch_size": section.batch_size,
    }
    every = cfg.trainer.checkpoint_every if section.every is None else section.every
    return [LMEvalCallback(list(section.tasks), every, **options)]

"""Composing a run config from command-line style overrides, and explaining bad ones.

`compose(["model=xor", "trainer.steps=500"])` is what `python -m zoo.train model=xor
trainer.steps=500` trains: Hydra composes the registered model's and data set's configs with the
overrides against the typed schema, then `zoo.engine.loop.config_checks` checks the values (and
`zoo.lm_evaluation` the tasks of `lm_eval`). Every failure is
one paragraph naming the bad override and what would be valid.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from zoo.defaults import (
    fit_context,
    fit_epochs,
    fit_finetune_defaults,
    fit_normalisation,
    fit_tokenizer,
)
from zoo.engine import registry
from zoo.engine.config import reason as config_reason
from zoo.engine.errors import ZooError
from zoo.engine.loop import CADENCES, validate
from zoo.hydra_store import store_registry
from zoo.lm_evaluation import check_lm_eval
from zoo.pretrained import pretrained_args

log = logging.getLogger("zoo")

CONFIG_DIR = os.path.dirname(os.path.abspath(__file__))
"""Hydra's config dir: this package, which holds no YAML (every config is in the ConfigStore)."""


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """The resolved run config for command-line style `overrides`, e.g. `["model=xor"]`.

    `finetune.init_from=DIR` on a pretrained checkpoint directory sets the model's sizes and
    the tokenizer from it (see `zoo.pretrained`); zoo's own defaults are fitted to the model
    (see `zoo.defaults`), and `trainer.epochs` becomes `trainer.steps`. Raises `ZooError` with a
    one-paragraph message for an unknown model, data set or key, or a value of the wrong type.
    """
    return composed(overrides)


def composed(
    overrides: Sequence[str],
    finetune: Mapping[str, Any] | None = None,
    train: Any = None,
) -> DictConfig:
    """`compose`, with `finetune.*` values set on the config before it is fitted and checked
    (`zoo.finetune`'s arguments: path patterns and lists, which overrides would have to
    quote), and the training split where the caller holds the data (`trainer.epochs` counts
    its rows; the registered data set's otherwise)."""
    overrides = list(overrides)
    overrides += pretrained_args(overrides)
    check_choices(overrides)
    try:
        cfg = _compose(overrides)
        for key, value in (finetune or {}).items():
            cfg.finetune[key] = value
        fit_normalisation(cfg, overrides)
        fit_context(cfg, overrides)
        fit_epochs(cfg, overrides, train)  # the steps, before all that depends on them
        fit_finetune_defaults(cfg, overrides)
        _fit_default_warmup(cfg, overrides)
        _fit_default_dispatch(cfg, overrides)
        validate(cfg)
        check_lm_eval(cfg)
        fit_tokenizer(cfg, overrides)
    except ZooError:
        raise
    except OmegaConfBaseException as e:
        raise ZooError(_explain(e, overrides)) from None
    except HydraException as e:  # Hydra wraps OmegaConf errors in its own exception types.
        cause = e
        while cause.__cause__ is not None:
            cause = cause.__cause__
        if isinstance(cause, OmegaConfBaseException):
            raise ZooError(_explain(cause, overrides)) from None
        raise ZooError(
            f"Invalid config overrides {overrides}: {' '.join(str(e).split())}"
        ) from None
    OmegaConf.resolve(cfg)
    return cfg


def _fit_default_warmup(cfg: DictConfig, overrides: list[str]) -> None:
    """A trial run (`trainer.steps=40`) of a model whose default warm-up is longer: the warm-up
    keeps its share of the model's default run, said in one line. A warm-up the overrides set
    stays as it is (and `validate` refuses it when it is too long)."""
    warmup, steps = int(cfg.optimizer.warmup_steps), int(cfg.trainer.steps)
    if warmup <= steps or "optimizer.warmup_steps" in _keys(overrides) or steps < 1:
        return
    default_steps = int(registry.get_model(cfg.model.name).trainer.get("steps", steps))
    scaled = min(steps, round(warmup * steps / max(default_steps, steps)))
    cfg.optimizer.warmup_steps = scaled
    log.info(
        "optimizer.warmup_steps: model '%s' warms up for %d steps in its default run of %d, "
        "longer than this run's trainer.steps=%d; warming up for %d steps instead, the same "
        "share (set optimizer.warmup_steps to choose).",
        cfg.model.name,
        warmup,
        default_steps,
        steps,
        scaled,
    )


def _fit_default_dispatch(cfg: DictConfig, overrides: list[str]) -> None:
    """A model's default `steps_per_dispatch` that does not divide a trial run's steps (or
    another cadence): the largest that divides them all, said in one line."""
    trainer = cfg.trainer
    k = int(trainer.steps_per_dispatch)
    if "trainer.steps_per_dispatch" in _keys(overrides) or k < 1:
        return
    fitted = math.gcd(k, *(max(int(trainer[key]), 0) for key in CADENCES))
    if fitted != k:
        trainer.steps_per_dispatch = fitted
        log.info(
            "trainer.steps_per_dispatch: model '%s' runs %d steps per dispatch by default, "
            "which does not divide this run's cadences; running %d instead (set "
            "trainer.steps_per_dispatch to choose).",
            cfg.model.name,
            k,
            fitted,
        )


def _keys(overrides: Sequence[str]) -> set[str]:
    return {o.split("=")[0].lstrip("+~") for o in overrides}


def _compose(overrides: list[str]) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    store_registry()
    # `initialize(config_path=None)` would do the same after naming its caller from
    # `inspect.stack()`, which reads the path of every module loaded (70 ms in a process that
    # has imported jax, at its first composition).
    with initialize_config_dir(CONFIG_DIR, job_name="zoo", version_base=None):
        return hydra_compose("config", overrides=overrides)


def sweep_jobs(overrides: Sequence[str]) -> list[list[str]]:
    """The overrides of each job of a sweep: one job per combination of the comma-separated
    values (`seed=0,1 optimizer.learning_rate=0.1,0.01`: four jobs), in Hydra's order."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    try:
        (jobs,) = BasicSweeper.split_arguments(_parsed(overrides), max_batch_size=None)
    except HydraException as e:
        raise ZooError(f"Cannot sweep over {list(overrides)}: {' '.join(str(e).split())}") from None
    return jobs


def _parsed(overrides: Sequence[str]) -> list:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as e:
        raise ZooError(f"Cannot parse the overrides {list(overrides)}: {e}") from None


def typed_argument(argument: str) -> tuple[str, Any]:
    """The key and value of one `key=value` command-line argument, the value typed as a run's
    overrides type theirs: `true`/`false`, numbers, `null`, `[lists]`, `{maps}`, else text
    (quoted to hold a comma); a `ZooError` naming an argument that does not parse or that
    gives several values."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        override = OverridesParser.create().parse_override(argument)
    except HydraException as e:
        lines = str(e).splitlines()  # "Error parsing override ...", the reason, "See <url>"
        reason = lines[1] if len(lines) == 3 else " ".join(lines)
        raise ZooError(
            f"Cannot read '{argument}' as KEY=VALUE ({reason.strip()}): a key of words joined "
            "by dots, and a value such as true, 3, 0.5, null, [a, b] or text."
        ) from None
    if override.is_sweep_override():
        raise ZooError(
            f"'{argument}' gives several values: give one (quote text that holds a comma, "
            f"{override.key_or_group}='a,b')."
        )
    return override.key_or_group, override.value()


def check_once(overrides: Sequence[str]) -> None:
    """Refuse a key typed twice on a command line: the last would win silently. (A program
    that composes a base list and then overrides some of its keys is not refused.)"""
    seen: dict[str, str] = {}
    for override in _parsed(overrides):
        key = override.key_or_group
        if key in seen:
            raise ZooError(
                f"{key} is given twice ('{seen[key]}' and '{override.input_line}'): give each "
                "key once; to run several values, sweep over them with -m and a comma "
                f"(-m {key}=a,b)."
            )
        seen[key] = override.input_line


def check_choices(overrides: Sequence[str]) -> None:
    """Reject an unknown `model=`/`data=` choice with the list of registered ones."""
    for override in _parsed(overrides):
        key = override.key_or_group
        if key in ("model", "data") and not override.is_sweep_override():
            value = override.value()
            valid = registry.list_models() if key == "model" else registry.list_datasets()
            if value not in valid:
                kind = "model" if key == "model" else "data set"
                raise ZooError(
                    f"Unknown {kind} '{value}' (from '{override.input_line}'). "
                    f"Valid choices: {', '.join(valid)}."
                )


def _explain(error: OmegaConfBaseException, overrides: list[str]) -> str:
    """One paragraph naming the bad override, why it is bad, and the valid keys around it."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    key = getattr(error, "full_key", None) or ""
    reason = config_reason(error)
    culprit = next((o for o in overrides if o.lstrip("+~").split("=")[0] == key), None)
    message = f"Invalid override '{culprit}': {reason}" if culprit else f"Invalid config: {reason}"
    if isinstance(error, ConfigKeyError | ConfigAttributeError) and culprit:
        parent = key.rpartition(".")[0]
        try:
            node = OmegaConf.select(_compose([o for o in overrides if o != culprit]), parent)
        except (HydraException, OmegaConfBaseException):
            node = None
        if isinstance(node, DictConfig):
            where = f"'{parent}'" if parent else "the top level"
            message += f". Valid keys at {where}: {', '.join(str(k) for k in node)}"
    if "is not a ListConfig" in reason and culprit:
        value = culprit.partition("=")[2]
        message = f"{message.rstrip('.')}. The key takes a list: {key}=[{value}]"
    return message.rstrip(".") + "."

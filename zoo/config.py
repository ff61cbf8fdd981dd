"""The typed config schema, its Hydra ConfigStore entries, and composition from overrides.

Layout of the Hydra configs (all in the ConfigStore, no YAML files):
- `zoo_schema`: the `Config` dataclass, so a wrong key or type fails at composition.
- `model/<name>`: one per registered model, in the `_global_` package, because choosing a model
  sets more than `model.*`: its default data set (a defaults-list entry `/data: <name>`, which
  `data=<other>` on the command line replaces) and its own `trainer.*`/`optimizer.*` defaults.
- `data/<name>`: one per registered data set.
- `config`: the primary config: schema, then the default model, then Hydra's own settings.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import typing
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from zoo.errors import ZooError

DEFAULT_MODEL = "xor"


class OptimizerName(str, enum.Enum):
    sgd = "sgd"
    adam = "adam"
    adamw = "adamw"


class BestMode(str, enum.Enum):
    min = "min"
    max = "max"


class NanPolicy(str, enum.Enum):
    stop = "stop"
    skip = "skip"


class ScheduleName(str, enum.Enum):
    constant = "constant"
    cosine = "cosine"
    linear = "linear"


@dataclasses.dataclass
class TrainerConfig:
    steps: int = 1000
    batch_size: int = 128
    # Eval (over the whole eval split) every N steps and always after the last step; 0: only then.
    eval_every: int = 0
    log_every: int = 50
    # Checkpoint every N steps and always after the last step; 0: only then.
    checkpoint_every: int = 0
    # Keep the latest N checkpoints (and the best one, with `best_metric`).
    keep: int = 3
    # Also keep the checkpoint with the best value of this eval metric (e.g. `loss`, `accuracy`)
    # among those saved at an eval step; null: keep only the latest.
    best_metric: str | None = None
    best_mode: BestMode = BestMode.min  # `min` for a loss, `max` for an accuracy
    # `auto`: continue from the latest readable checkpoint in the workdir, if any; `never`: start
    # fresh (refused if the workdir holds checkpoints); a step number: continue from that one.
    resume: str = "auto"
    # A NaN or Inf training loss: `stop` the run (keeping the last good checkpoint), or `skip`
    # that step's update and go on.
    nan_policy: NanPolicy = NanPolicy.stop
    # Run this many train steps per call from the host, in one compiled loop (same bits, metrics
    # still per step): pays off for tiny models, whose steps are shorter than the host's work
    # per step. steps, log_every, eval_every and checkpoint_every must be multiples of it.
    steps_per_dispatch: int = 1
    # `[first, last]`: write a JAX profiler trace of these steps into the run's TensorBoard
    # directory; empty: no trace.
    profile_steps: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class LoggingConfig:
    # Histograms of every param and its gradient every N steps; 0: never (the default: they
    # cost a second gradient computation at each of those steps).
    histogram_every: int = 0
    # Global gradient norm, parameter norm and update/parameter ratio, sampled every N steps
    # (each sample costs about one extra gradient computation); 0: never.
    norms_every: int = 500


@dataclasses.dataclass
class OptimizerConfig:
    name: OptimizerName = OptimizerName.adam
    learning_rate: float = 1e-3
    # The peak learning rate is reached after `warmup_steps` of linear warm-up, then `schedule`
    # decays it to `learning_rate * final_lr_fraction` at the last step.
    schedule: ScheduleName = ScheduleName.constant
    warmup_steps: int = 0
    final_lr_fraction: float = 0.0
    momentum: float = 0.0  # sgd only; 0 is plain SGD
    weight_decay: float = 1e-4  # adamw only
    grad_clip_norm: float | None = None


MESH_AXES = ("data", "fsdp", "tensor")

DEFAULT_RULES: dict[str, Any] = {
    "batch": ["data", "fsdp"],
    "embed": "fsdp",
    "mlp": "tensor",
    "heads": "tensor",
    "vocab": "tensor",
    "conv_in": None,
    "conv_out": "tensor",
}
"""Logical axis -> mesh axes: one axis, a list of axes, or None (replicated)."""


@dataclasses.dataclass
class MeshConfig:
    # Devices along each mesh axis; one may be -1: all the remaining devices.
    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    rules: dict[str, Any] = dataclasses.field(default_factory=lambda: dict(DEFAULT_RULES))
    # Simulated CPU devices for this process (0: what the platform has); must be set before
    # JAX starts, so it works from the command line, not after JAX is already in use.
    cpu_devices: int = 0


@dataclasses.dataclass
class DistributedConfig:
    # Several processes (one per host, typically): set these, or let JAX read them from the
    # environment (JAX_COORDINATOR_ADDRESS, SLURM, Open MPI, Kubernetes).
    coordinator: str | None = None  # host:port of process 0
    num_processes: int | None = None
    process_id: int | None = None
    # A process that has not been heard from for this long is dead: the others stop with an
    # error instead of waiting for it forever.
    heartbeat_timeout: int = 100


@dataclasses.dataclass
class FinetuneConfig:
    # Start from the weights of another run: its workdir (null: fresh weights). Params and
    # BatchNorm statistics are restored; RNG streams and the optimizer start fresh.
    init_from: str | None = None
    # Which of its checkpoints: `latest`, `best` (by its trainer.best_metric, else eval loss) or
    # a step number.
    init_step: str = "latest"
    # Params that keep their fresh initialisation instead of being restored (path patterns,
    # e.g. [head] for a new classification head). Any other param whose shape differs from the
    # checkpoint's is an error.
    reinit: list[str] = dataclasses.field(default_factory=list)
    # Params that get no gradient and no optimizer state: a path pattern, or `backbone` for every
    # param outside `head`. A BatchNorm whose params are all frozen keeps its statistics too.
    freeze: str | None = None
    # The path of the model's classification head (every model of the zoo calls it `head`).
    head: str = "head"
    # Add LoRA adapters of this rank to the Linear layers that `lora_layers` matches and train
    # only them (and the params in `reinit`); 0: no adapters.
    lora_rank: int = 0
    lora_layers: str = ".*"


@dataclasses.dataclass
class Config:
    model: Any = MISSING
    data: Any = MISSING
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    finetune: FinetuneConfig = dataclasses.field(default_factory=FinetuneConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    workdir: str = "runs/${model.name}/${now:%Y%m%d-%H%M%S}"
    seed: int = 0


HELP_TEMPLATE = """\
zoo: train a model of the zoo with one command.

Usage:   python -m zoo.train [model=NAME] [data=NAME] [KEY=VALUE ...] [--cfg job]

Models and data sets (each model names its default data set; `data=NAME` replaces it):
$APP_CONFIG_GROUPS
Examples:
  python -m zoo.train model=xor
  python -m zoo.train model=xor trainer.steps=500 optimizer.name=adam optimizer.learning_rate=0.01
  python -m zoo.train model=xor workdir=runs/my-run seed=1
  python -m zoo.train model=xor --cfg job        # print the resolved config, train nothing

Every run writes TensorBoard events, checkpoints and train.log under `workdir`
(`tensorboard --logdir runs` shows all runs). The default config, every key overridable:

$CONFIG"""

# Console: zoo's own lines plus real warnings from anywhere; the INFO chatter of absl, Orbax and
# JAX goes only to `<workdir>/train.log`.
JOB_LOGGING = {
    "version": 1,
    "formatters": {
        "console": {"format": "%(message)s"},
        "file": {"format": "[%(asctime)s][%(name)s][%(levelname)s] %(message)s"},
    },
    "handlers": {
        "console": {"class": "zoo.console.ConsoleHandler", "formatter": "console"},
        "file": {
            "class": "logging.FileHandler",
            "formatter": "file",
            "filename": "${hydra.runtime.output_dir}/${hydra.job.name}.log",
        },
    },
    "root": {"level": "INFO", "handlers": ["console", "file"]},
    "disable_existing_loggers": False,
}

_PRIMARY = {
    "defaults": [
        "zoo_schema",
        {"model": DEFAULT_MODEL},
        {"override hydra/job_logging": "zoo"},
        "_self_",
    ],
    "hydra": {
        "run": {"dir": "${workdir}"},
        "sweep": {"dir": "${workdir}", "subdir": "${hydra.job.num}"},
        "help": {"app_name": "zoo", "template": HELP_TEMPLATE},
    },
}


def _store_base() -> None:
    cs = ConfigStore.instance()
    cs.store(name="zoo_schema", node=Config)
    cs.store(group="hydra/job_logging", name="zoo", node=JOB_LOGGING)
    cs.store(name="config", node=_PRIMARY)


_store_base()


def store_model(
    name: str,
    schema: type,
    default_data: str,
    trainer: Mapping[str, Any],
    optimizer: Mapping[str, Any],
    data: Mapping[str, Any],
) -> None:
    node: dict[str, Any] = {"defaults": [{"/data": default_data}, "_self_"], "model": schema}
    for section, values in (("trainer", trainer), ("optimizer", optimizer), ("data", data)):
        if values:
            node[section] = dict(values)
    ConfigStore.instance().store(group="model", name=name, node=node, package="_global_")


def store_data(name: str, schema: type) -> None:
    ConfigStore.instance().store(group="data", name=name, node=schema)


def checked_dict(schema: type, values: Mapping[str, Any], what: str) -> dict[str, Any]:
    """Defaults of `schema` updated by `values`, type-checked the same way the CLI checks."""
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(schema), dict(values))
    except OmegaConfBaseException as e:
        raise ZooError(f"Invalid value for {what}: {_reason(e)}.") from None
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    """The resolved run config for command-line style `overrides`, e.g. `["model=xor"]`.

    Raises `ZooError` with a one-paragraph message for an unknown model, data set or key, or a
    value of the wrong type.
    """
    overrides = list(overrides)
    check_choices(overrides)
    try:
        cfg = _compose(overrides)
        _check_schema(cfg)
        _check_values(cfg)
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


def _compose(overrides: list[str]) -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize

    with initialize(version_base=None, config_path=None):
        return hydra_compose("config", overrides=overrides)


def _check_schema(cfg: DictConfig) -> None:
    """Hydra's `+key=value` adds keys even to typed nodes: reject any key that no schema has,
    with the chosen model's and data set's own schemas standing in for `model` and `data`."""
    from zoo import registry

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


def _check_values(cfg: DictConfig) -> None:
    """Range checks that types alone cannot express."""
    trainer = cfg.trainer
    for key in ("steps", "batch_size", "log_every"):
        if trainer[key] < 1:
            raise ZooError(f"trainer.{key}={trainer[key]} must be at least 1.")
    for key in ("eval_every", "checkpoint_every"):
        if trainer[key] < 0:
            raise ZooError(f"trainer.{key}={trainer[key]} must be 0 (off) or positive.")
    from train.dispatch import check_cadences  # train imports this module

    check_cadences(trainer)
    if trainer.keep < 1:
        raise ZooError(
            f"trainer.keep={trainer.keep} must be at least 1: the latest checkpoint is always kept."
        )
    _check_profile_steps(list(trainer.profile_steps), trainer.steps)
    for key in ("histogram_every", "norms_every"):
        if cfg.logging[key] < 0:
            raise ZooError(f"logging.{key}={cfg.logging[key]} must be 0 (off) or positive.")
    if resume_step(trainer.resume) is None and trainer.resume not in ("auto", "never"):
        raise ZooError(
            f"trainer.resume={trainer.resume} must be 'auto', 'never' or a step number (an "
            "integer >= 0)."
        )
    from train.sharding import AxisRules, check_mesh_sizes  # train imports this module

    check_mesh_sizes(cfg.mesh)
    AxisRules.from_mapping(cfg.mesh.rules)
    optimizer = cfg.optimizer
    if optimizer.learning_rate <= 0:
        raise ZooError(f"optimizer.learning_rate={optimizer.learning_rate} must be positive.")
    if not 0 <= optimizer.warmup_steps <= trainer.steps:
        raise ZooError(
            f"optimizer.warmup_steps={optimizer.warmup_steps} must lie between 0 and "
            f"trainer.steps={trainer.steps}."
        )
    check_finetune(cfg.finetune)


def check_finetune(finetune: Any) -> None:
    """Range and syntax checks of the `finetune` section."""
    if finetune.lora_rank < 0:
        raise ZooError(f"finetune.lora_rank={finetune.lora_rank} must be 0 (off) or positive.")
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


def _check_profile_steps(steps: list[int], total: int) -> None:
    if not steps:
        return
    if len(steps) != 2 or not 1 <= steps[0] <= steps[1] <= total:
        raise ZooError(
            f"trainer.profile_steps={steps} must be [] (no trace) or [first, last], two steps "
            f"with 1 <= first <= last <= trainer.steps={total}, e.g. trainer.profile_steps=[10,20]."
        )


def resume_step(resume: Any) -> int | None:
    """The step that `trainer.resume` names, or None for `auto`/`never`/anything else."""
    text = str(resume).strip()
    return int(text) if text.isdigit() else None


def check_choices(overrides: Sequence[str]) -> None:
    """Reject an unknown `model=`/`data=` choice with the list of registered ones."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from zoo import registry

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as e:
        raise ZooError(f"Cannot parse the overrides {list(overrides)}: {e}") from None
    for override in parsed:
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


def _reason(error: OmegaConfBaseException) -> str:
    return " ".join(str(getattr(error, "msg", None) or error).split("\n")[0].split())


def _explain(error: OmegaConfBaseException, overrides: list[str]) -> str:
    """One paragraph naming the bad override, why it is bad, and the valid keys around it."""
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    key = getattr(error, "full_key", None) or ""
    reason = _reason(error)
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
    return message.rstrip(".") + "."

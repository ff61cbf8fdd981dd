"""Hydra's configs for the command line and `zoo.compose`, built from the registry.

All of them live in Hydra's ConfigStore (no YAML files):
- `zoo_schema`: the `Config` dataclass, so a wrong key or type fails at composition.
- `model/<name>`: one per registered model, in the `_global_` package, because choosing a model
  sets more than `model.*`: its default data set (a defaults-list entry `/data: <name>`, which
  `data=<other>` on the command line replaces) and its own `trainer.*`/`optimizer.*` defaults.
- `data/<name>`: one per registered data set.
- `config`: the primary config: schema, then the default model, then Hydra's own settings.

`store_registry()` writes them from the registry's records each time a config is composed (a
record stored before is not converted again), so a model registered by user code at any time is
a valid choice.
"""

from __future__ import annotations

from typing import Any

from hydra.core.config_store import ConfigStore

from zoo.engine import registry
from zoo.engine.config import Config
from zoo.pretrained import families_help

DEFAULT_MODEL = "xor"

HELP_TEMPLATE = """\
zoo: train a model of the zoo with one command.

Usage:   python -m zoo.train [model=NAME] [data=NAME] [KEY=VALUE ...] [--cfg job]

Models and data sets (each model names its default data set; `data=NAME` replaces it):
$APP_CONFIG_GROUPS
Pretrained checkpoints (`finetune.init_from=DIR`: config.json + safetensors) each model loads:
$PRETRAINED
Examples:
  python -m zoo.train model=xor
  python -m zoo.train model=xor trainer.steps=500 optimizer.name=adam optimizer.learning_rate=0.01
  python -m zoo.train model=xor workdir=runs/my-run seed=1
  python -m zoo.train model=xor --cfg job        # print the resolved config, train nothing
  python -m zoo.train finetune.init_from=gpt2 data.path=my_text.txt   # fine-tune GPT-2

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
        "console": {"class": "zoo.engine.report.ConsoleHandler", "formatter": "console"},
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
    },
}


def _primary() -> dict[str, Any]:
    """The primary config; its `--help` lists the checkpoint families registered by now."""
    help = {"app_name": "zoo", "template": HELP_TEMPLATE.replace("$PRETRAINED", families_help())}
    return {**_PRIMARY, "hydra": {**_PRIMARY["hydra"], "help": help}}


def store_registry() -> None:
    """Store the primary config and one config per registered model and data set, each entry
    once: registry entries are frozen, so one stored before is stored as it is (converting them
    all again took 40 ms of every composition)."""
    cs = ConfigStore.instance()
    _store_once(cs, Config, name="zoo_schema", node=Config)
    _store_once(cs, JOB_LOGGING, group="hydra/job_logging", name="zoo", node=JOB_LOGGING)
    cs.store(name="config", node=_primary())
    for name in registry.list_models():
        model = registry.get_model(name)
        _store_once(cs, model, group="model", name=name, node=_model_node(name), package="_global_")
    for name in registry.list_datasets():
        entry = registry.get_data(name)
        _store_once(cs, entry, group="data", name=name, node=entry.config)


_STORED: dict[tuple[str | None, str], Any] = {}
"""(group, name) -> the record its config was stored from."""


def _store_once(
    cs: ConfigStore, record: Any, *, name: str, group: str | None = None, **store: Any
) -> None:
    """`cs.store(group=group, name=name, **store)` unless `record` is what it was stored from."""
    if _STORED.get((group, name)) is record:
        return
    cs.store(group=group, name=name, **store)
    _STORED[(group, name)] = record


def _model_node(name: str) -> dict[str, Any]:
    entry = registry.get_model(name)
    node: dict[str, Any] = {"defaults": [{"/data": entry.default_data}, "_self_"]}
    node["model"] = entry.config
    for section in ("trainer", "optimizer", "data"):
        if getattr(entry, section):
            node[section] = dict(getattr(entry, section))
    return node

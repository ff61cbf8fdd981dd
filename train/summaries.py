"""What describes a run rather than its progress: the model's layers and the HParams entry.

Both are written once when a run starts, so TensorBoard's Text tab shows what was trained and
its HParams tab compares runs by their config against their latest eval metrics.

TensorBoard's HParams tab takes the experiment description (every key and metric it offers)
from one run of the logdir, whichever it reads first, and drops the others'. So every run
writes the same description: the keys and metrics of every registered model and data set, not
only its own, with the five keys that tell runs apart first (the tab's default columns).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from flax import nnx
from tensorboardX.proto.api_pb2 import DataType, Experiment, HParamInfo, MetricInfo, MetricName
from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData
from tensorboardX.proto.summary_pb2 import Summary, SummaryMetadata
from tensorboardX.summary import hparams
from zoo.engine import registry
from zoo.engine.config import Config
from zoo.engine.report import val_tag

HParamValue = bool | int | float | str


def model_summary(model: nnx.Module) -> str:
    """One row per layer that holds params: its path, type, param shapes and count, then the
    total (the same counts as `nnx.tabulate`, without calling the model)."""
    modules = {tuple(path): module for path, module in nnx.iter_modules(model)}
    layers: dict[tuple, list[tuple[str, tuple[int, ...]]]] = {}
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        layers.setdefault(tuple(path[:-1]), []).append((str(path[-1]), tuple(variable.shape)))
    rows = [("layer", "type", "params", "count")]
    total = 0
    for path, params in layers.items():
        count = sum(math.prod(shape) for _, shape in params)
        total += count
        shapes = ", ".join(f"{name} {shape}" for name, shape in params)
        kind = type(modules[path]).__name__ if path in modules else "-"
        rows.append(("/".join(map(str, path)) or "(model)", kind, shapes, f"{count:,}"))
    rows.append(("total", "", "", f"{total:,}"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = []
    for *text, count in rows:
        cells = [cell.ljust(width) for cell, width in zip(text, widths, strict=False)]
        lines.append("  ".join([*cells, count.rjust(widths[3])]))
    return "\n".join(lines)


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, HParamValue]:
    """`{"trainer.steps": 100, ...}`: every leaf of the resolved config, as HParams values
    (numbers, booleans and strings; lists and null as their text)."""
    flat: dict[str, HParamValue] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flat_config(value, f"{name}."))
        elif isinstance(value, bool | int | float | str):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat


DEFAULT_COLUMNS = ("model.name", "data.name", "seed", "optimizer.learning_rate", "trainer.steps")
"""The HParams tab's columns at first: it shows the first five keys, those marked `differs`
first."""
EXPERIMENT_TAG = "_hparams_/experiment"


def hparams_summaries(config: Mapping[str, Any], metric_tags: Sequence[str]) -> list[Any]:
    """The HParams plugin's experiment and session-start summaries for this run: its flattened
    config, and the scalar tags (e.g. `val/accuracy`) whose latest values are its metrics."""
    values = flat_config(config)
    _, session_start, _ = hparams(values, {})
    return [experiment_summary(values, metric_tags), session_start]


def experiment_summary(values: Mapping[str, HParamValue], metric_tags: Sequence[str]) -> Any:
    """The experiment description: every registered model's and data set's keys and eval
    metrics, the common sections' keys, and this run's own, with `DEFAULT_COLUMNS` first."""
    types = {**_key_types(Config), **_registered_key_types()}
    for name, value in values.items():  # keys that no schema names (e.g. `mesh.rules.*`)
        types.setdefault(name, _data_type(type(value)))
    infos = [_hparam_info(name, data_type) for name, data_type in sorted(types.items())]
    metrics = sorted({*metric_tags, *_registered_metric_tags()})
    experiment = Experiment(
        hparam_infos=infos, metric_infos=[MetricInfo(name=MetricName(tag=t)) for t in metrics]
    )
    content = HParamsPluginData(experiment=experiment, version=0).SerializeToString()
    metadata = SummaryMetadata(
        plugin_data=SummaryMetadata.PluginData(plugin_name="hparams", content=content)
    )
    return Summary(value=[Summary.Value(tag=EXPERIMENT_TAG, metadata=metadata)])


DIFFERS = b"\x38\x01"
"""`differs: true`: field 7 of TensorBoard's HParamInfo, which tensorboardX's copy of the proto
lacks; the parser keeps it as an unknown field and writes it back as it is."""


def _hparam_info(name: str, data_type: int) -> HParamInfo:
    info = HParamInfo(name=name, type=data_type).SerializeToString()
    return HParamInfo.FromString(info + DIFFERS if name in DEFAULT_COLUMNS else info)


def _registered_key_types() -> dict[str, int]:
    types: dict[str, int] = {}
    for name in registry.list_models():
        types.update(_key_types(registry.get_model(name).config, "model."))
    for name in registry.list_datasets():
        types.update(_key_types(registry.get_data(name).config, "data."))
    return types


def _registered_metric_tags() -> set[str]:
    tags = {"train/loss", val_tag("loss")}
    for name in registry.list_models():
        tags.update(val_tag(metric) for metric in registry.get_model(name).metrics)
    return tags


def _key_types(schema: type, prefix: str = "") -> dict[str, int]:
    """`{"trainer.steps": FLOAT64, ...}` for the fields of a config dataclass, nested ones
    flattened (`model` and `data`, typed `Any` in `Config`, come from the registry)."""
    hints = typing.get_type_hints(schema)
    types: dict[str, int] = {}
    for field in dataclasses.fields(schema):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            types.update(_key_types(hint, f"{prefix}{field.name}."))
        elif hint is not Any and typing.get_origin(hint) is not dict:
            types[f"{prefix}{field.name}"] = _data_type(hint)
    return types


def _data_type(hint: Any) -> int:
    """How HParams shows a key: a number (`int`, `float`, or None), a boolean, else text (lists,
    enums, strings)."""
    kinds = set(typing.get_args(hint) or (hint,)) - {type(None)}
    if kinds == {bool}:
        return DataType.DATA_TYPE_BOOL
    if kinds and kinds <= {int, float}:
        return DataType.DATA_TYPE_FLOAT64
    return DataType.DATA_TYPE_STRING

"""What describes a run rather than its progress: the model's layers and the HParams entry.

Both are written once when a run starts, so TensorBoard's Text tab shows what was trained and
its HParams tab compares runs by their config against their latest eval metrics.

TensorBoard's HParams tab takes the experiment description (every key and metric it offers)
from one run of the logdir, whichever it reads first, and drops the others'. So every run
writes the same description: a few keys that tell runs apart (`COLUMNS`, model first), and the
eval metrics of every registered model, not only its own.
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
from zoo.engine.report.reporter import val_tag

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


COLUMNS = (
    "model.name",
    "data.name",
    "seed",
    "optimizer.learning_rate",
    "trainer.steps",
    "trainer.batch_size",
    "optimizer.name",
    "optimizer.schedule",
    "optimizer.weight_decay",
    "trainer.precision",
    "finetune.init_from",
)
"""The HParams tab's columns, in this order (it shows the first five at first): what tells runs
apart. The whole config is in the Text tab (`config`)."""
EXPERIMENT_TAG = "_hparams_/experiment"


def column_name(key: str) -> str:
    """The HParams name of a column (`01 model.name`). The tab sorts columns by name and shows
    each by its display name, the key itself: the number keeps them in `COLUMNS` order."""
    return f"{COLUMNS.index(key) + 1:02d} {key}"


def hparams_summaries(config: Mapping[str, Any], metric_tags: Sequence[str]) -> list[Any]:
    """The HParams plugin's experiment and session-start summaries for this run: the `COLUMNS`
    of its config, and the scalar tags (e.g. `val/accuracy`) whose latest values are its
    metrics."""
    flat = flat_config(config)
    values = {column_name(key): column_value(flat[key]) for key in COLUMNS}
    _, session_start, _ = hparams(values, {})
    return [experiment_summary(metric_tags), session_start]


def column_value(value: HParamValue) -> HParamValue:
    """A whole number as its text (`60`): the tab writes every number with five significant
    digits (`60.000`). Other values as they are."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


def experiment_summary(metric_tags: Sequence[str]) -> Any:
    """The experiment description: the `COLUMNS` and every registered model's eval metrics (the
    same in every run, whichever run the tab takes it from)."""
    types = _key_types(Config)
    infos = [
        HParamInfo(
            name=column_name(key),
            display_name=key,
            type=types.get(key, DataType.DATA_TYPE_STRING),
        )
        for key in COLUMNS
    ]
    metrics = sorted({*metric_tags, *_registered_metric_tags()})
    experiment = Experiment(
        hparam_infos=infos, metric_infos=[MetricInfo(name=MetricName(tag=t)) for t in metrics]
    )
    content = HParamsPluginData(experiment=experiment, version=0).SerializeToString()
    metadata = SummaryMetadata(
        plugin_data=SummaryMetadata.PluginData(plugin_name="hparams", content=content)
    )
    return Summary(value=[Summary.Value(tag=EXPERIMENT_TAG, metadata=metadata)])


def _registered_metric_tags() -> set[str]:
    tags = {"train/loss", val_tag("loss")}
    for name in registry.list_models():
        tags.update(val_tag(metric) for metric in registry.get_model(name).metrics)
    return tags


def _key_types(schema: type, prefix: str = "") -> dict[str, int]:
    """`{"optimizer.learning_rate": FLOAT64, ...}` for the fields of a config dataclass, nested
    ones flattened."""
    hints = typing.get_type_hints(schema)
    types: dict[str, int] = {}
    for field in dataclasses.fields(schema):
        hint = hints[field.name]
        if dataclasses.is_dataclass(hint):
            types.update(_key_types(hint, f"{prefix}{field.name}."))
        else:
            types[f"{prefix}{field.name}"] = _data_type(hint)
    return types


def _data_type(hint: Any) -> int:
    """How HParams shows a key: a boolean, a number (a `float` that is never None: one scale,
    a range filter), else text (whole numbers, as `column_value` writes them; names, lists)."""
    if hint is bool:
        return DataType.DATA_TYPE_BOOL
    if hint is float:
        return DataType.DATA_TYPE_FLOAT64
    return DataType.DATA_TYPE_STRING

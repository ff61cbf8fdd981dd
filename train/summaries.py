"""What describes a run rather than its progress: the model's layers and the HParams entry.

Both are written once when a run starts, so TensorBoard's Text tab shows what was trained and
its HParams tab compares runs by their config against their latest eval metrics.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from flax import nnx
from tensorboardX.summary import hparams

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


def hparams_summaries(config: Mapping[str, Any], metric_tags: Sequence[str]) -> list[Any]:
    """The HParams plugin's experiment and session-start summaries for this run: its flattened
    config, and the scalar tags (e.g. `eval/accuracy`) whose latest values are its metrics."""
    experiment, session_start, _ = hparams(flat_config(config), dict.fromkeys(metric_tags, 0.0))
    return [experiment, session_start]

"""Bad inputs made from good ones, for any model: each case turns a good batch into one the
model cannot take, and gives a regex that the `ZooError` refusing it must match (the bad
thing named: its dtype, its shape, the column it is in)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

Columns = dict[str, np.ndarray]


def _wider(array: np.ndarray) -> np.ndarray:
    """One more feature, pixel column or token on the last axis."""
    return np.concatenate([array, array[..., :1]], axis=-1)


def _ragged(array: np.ndarray) -> list:
    """Two examples as nested lists, the second one number short."""
    return [array[0].tolist(), array[1].reshape(-1)[:-1].tolist()]


def _shape(array: Any) -> str:
    return re.escape(str(np.shape(array)))


PREDICT: dict[str, Callable[[np.ndarray], tuple[Any, str]]] = {
    "strings": lambda x: (x.astype(str), r"of strings \(dtype <U"),
    "objects": lambda x: (x.astype(object), r"of Python objects \(dtype object\)"),
    "one example": lambda x: (x[0], r"without the batch axis; add it \(inputs\[None\]"),
    "a wider example": lambda x: (_wider(x), _shape(_wider(x))),
    "an extra axis": lambda x: (x[..., None], _shape(x[..., None])),
    "ragged rows": lambda x: (_ragged(x), r"do not make one array"),
    "a number": lambda x: (x.flat[0], r"of one number"),
}
"""Inputs to `zoo.predict`, from a good batch of them."""


def _renamed(columns: Columns, name: str) -> Columns:
    return {(f"{key}s" if key == name else key): value for key, value in columns.items()}


def _changed(columns: Columns, name: str, change: Callable[[np.ndarray], Any]) -> Columns:
    return {**columns, name: change(columns[name])}


def _outside_the_classes(columns: Columns, hparams: Mapping[str, Any]) -> Columns | None:
    if "label" not in columns or not isinstance(hparams.get("num_classes"), int):
        return None
    return _changed(columns, "label", lambda labels: np.full_like(labels, hparams["num_classes"]))


COLUMNS: dict[str, Callable[[Columns, str, Mapping[str, Any]], tuple[Columns | None, str]]] = {
    "a misnamed column": lambda c, n, h: (_renamed(c, n), rf"no column '{n}'"),
    "strings": lambda c, n, h: (_changed(c, n, lambda x: x.astype(str)), rf"'{n}'.*strings"),
    "objects": lambda c, n, h: (
        _changed(c, n, lambda x: x.astype(object)),
        rf"'{n}'.*Python objects",
    ),
    "one example": lambda c, n, h: (_changed(c, n, lambda x: x[0]), rf"'{n}'"),
    "one value": lambda c, n, h: (_changed(c, n, lambda x: x.flat[0]), rf"'{n}'"),
    "a label outside the classes": lambda c, n, h: (
        _outside_the_classes(c, h),
        r"'label' column holds \d+, outside the classes",
    ),
}
"""Columns for `zoo.evaluate` and `zoo.finetune`, from good ones as the model takes them and
the name of the column the model reads (`name`); None where a case does not apply."""

WIDER_COLUMNS: dict[str, Callable[[Columns, str, Mapping[str, Any]], tuple[Columns, str]]] = {
    "a wider example": lambda c, n, h: (
        _changed(c, n, _wider),
        rf"'{n}'.*{_shape(_wider(c[n])[0])}",
    ),
    "an extra axis": lambda c, n, h: (
        _changed(c, n, lambda x: x[..., None]),
        rf"'{n}'.*{_shape(c[n][0][..., None])}",
    ),
}
"""Columns whose examples a trained model cannot take, for `zoo.evaluate` (a fine-tune's
data decides its model's input shape where it can)."""

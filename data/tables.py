"""`data=arrayrecord` and `data=parquet`: labelled images in files of records or rows.

Both read two named columns: `data.image_column` (encoded image bytes, or an array of uint8
pixels, H x W or H x W x C) and `data.label_column` (integer labels 0..num_classes-1, or class
names, sorted into labels). `data.path` is a file, a folder of them, or a folder with `train/`
and `val/` folders of them (else each class's `data.eval_fraction` is held out by a fixed
seed, as for image folders).

- ArrayRecord (`*.array_record`, read with Grain's `ArrayRecordDataSource`): each record a
  msgpack map of the columns, as `python -m zoo.data convert images DIR OUT` writes them. The
  records stay on disk and are read as batches need them; their labels are read once up front.
- Parquet (`*.parquet`, read with pyarrow): the two columns are read into memory (encoded
  images are small); for data larger than memory, convert it to ArrayRecord.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grain
import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from zoo.data.examples import (
    ImageExamples,
    NormalizeBy,
    OnError,
    Subset,
    check_image_keys,
    held_out,
    readable,
)
from zoo.data.images import fingerprint, image_splits
from zoo.data.imaging import Augment

from zoo.plugin import Splits, ZooError, register_data

ARRAY_RECORD, PARQUET = ".array_record", ".parquet"


def split_files(path: str | None, suffix: str, what: str) -> tuple[list[str], list[str] | None]:
    """(training files, eval files or None) under `path`."""
    root = Path(path).expanduser() if path is not None else None
    if root is None or not root.exists():
        raise ZooError(
            f"data.path={path} does not exist: data={what} needs data.path naming a {suffix} "
            "file, a folder of them, or a folder with train/ and val/ folders of them."
        )
    if root.is_file():
        return [str(root)], None
    if (root / "train").is_dir() and (root / "val").is_dir():
        return _files(root / "train", suffix), _files(root / "val", suffix)
    return _files(root, suffix), None


def _files(folder: Path, suffix: str) -> list[str]:
    found = sorted(str(p) for p in folder.glob(f"*{suffix}") if p.is_file())
    if not found:
        raise ZooError(f"{folder} holds no {suffix} files.")
    return found


def label_array(values: Sequence[Any], classes: list[str] | None, where: str) -> np.ndarray:
    """Integer labels from integer or class-name values."""
    if classes is not None:
        index = {name: i for i, name in enumerate(classes)}
        unknown = sorted({str(v) for v in values if str(v) not in index})
        if unknown:
            raise ZooError(
                f"{where} has labels that are not among the training classes "
                f"({', '.join(classes[:20])}): {', '.join(unknown[:10])}."
            )
        return np.asarray([index[str(v)] for v in values], np.int32)
    try:
        return np.asarray(values, np.int64).astype(np.int32)
    except (TypeError, ValueError):
        raise ZooError(f"{where}: the labels are neither integers nor class names.") from None


def class_list(values: Sequence[Any]) -> list[str] | None:
    """The sorted class names when the labels are names, else None (integer labels)."""
    if len(values) and isinstance(values[0], str | bytes):
        return sorted({str(v) for v in values})
    return None


def check_labels(labels: np.ndarray, num_classes: int, where: str, column: str) -> None:
    bad = labels[(labels < 0) | (labels >= num_classes)]
    if bad.size:
        raise ZooError(
            f"{where}: the column '{column}' holds labels outside the {num_classes} classes "
            f"0..{num_classes - 1}: {sorted(set(bad.tolist()))[:10]}. Fix the labels, or set "
            "data.num_classes to the number of classes."
        )


# ---- Sources of payloads ----


class Records:
    """The image column of ArrayRecord shards, read record by record."""

    def __init__(self, files: list[str], image_column: str):
        self.files, self.image_column = files, image_column
        self.source = grain.sources.ArrayRecordDataSource(files)

    def __len__(self) -> int:
        return len(self.source)

    def record(self, index: int) -> dict[str, Any]:
        return msgpack.unpackb(self.source[index])

    def read(self, index: int) -> bytes | np.ndarray:
        return _pixels_or_bytes(self.record(index)[self.image_column])

    def name(self, index: int) -> str:
        return f"record {index} of {', '.join(self.files)}"

    def columns(self, label_column: str, where: str) -> list[Any]:
        """Every record's label, checking that each has both columns."""
        labels = []
        for index in range(len(self)):
            try:
                record = self.record(index)
            except (ValueError, msgpack.UnpackException):
                raise ZooError(f"{self.name(index)} is not a msgpack map of columns.") from None
            missing = [c for c in (self.image_column, label_column) if c not in record]
            if missing:
                raise ZooError(
                    f"{where}: {self.name(index)} lacks the column(s) {', '.join(missing)}; it "
                    f"has {', '.join(map(str, record))}. Set data.image_column and "
                    "data.label_column to its column names."
                )
            labels.append(record[label_column])
        return labels


class Rows:
    """The image column of Parquet files, in memory."""

    def __init__(self, column: pa.ChunkedArray, files: list[str]):
        self.column, self.files = column.combine_chunks(), files

    def __len__(self) -> int:
        return len(self.column)

    def read(self, index: int) -> bytes | np.ndarray:
        return _pixels_or_bytes(self.column[index].as_py())

    def name(self, index: int) -> str:
        return f"row {index} of {', '.join(self.files)}"


def _pixels_or_bytes(value: Any) -> bytes | np.ndarray:
    return value if isinstance(value, bytes) else np.asarray(value, np.uint8)


def read_parquet(files: list[str], columns: list[str], where: str) -> pa.Table:
    tables = []
    for file in files:
        names = pq.read_schema(file).names
        missing = [c for c in columns if c not in names]
        if missing:
            raise ZooError(
                f"{where}: {file} has no column(s) {', '.join(missing)}; its columns are "
                f"{', '.join(names)}. Set data.image_column and data.label_column to them."
            )
        tables.append(pq.read_table(file, columns=columns))
    return pa.concat_tables(tables)


# ---- The data sets ----


def _labelled(fmt: str, files: list[str], image_column: str, label_column: str):
    """(payloads, raw label values) of some files of format `fmt`."""
    where = f"data={fmt} data.path"
    if fmt == "arrayrecord":
        records = Records(files, image_column)
        return records, records.columns(label_column, where)
    table = read_parquet(files, [image_column, label_column], where)
    return Rows(table[image_column], files), table[label_column].to_pylist()


def _tables(fmt: str, suffix: str, params: dict[str, Any]) -> Splits:
    check_image_keys(**params)
    columns = params["image_column"], params["label_column"]
    train_files, val_files = split_files(params["path"], suffix, fmt)
    payloads, values = _labelled(fmt, train_files, *columns)
    if not len(payloads):
        raise ZooError(f"data.path={params['path']} holds no {fmt} examples.")
    classes = class_list(values)
    labels = label_array(values, classes, f"data.path={params['path']}")
    num_classes = params["num_classes"]
    if num_classes is None:
        num_classes = len(classes) if classes else int(labels.max()) + 1
    check_labels(labels, num_classes, f"data.path={params['path']}", columns[1])
    if val_files is not None:
        test_payloads, test_values = _labelled(fmt, val_files, *columns)
        test_labels = label_array(test_values, classes, ", ".join(val_files))
        check_labels(test_labels, num_classes, ", ".join(val_files), columns[1])
        train_rows, test_rows = np.arange(len(labels)), np.arange(len(test_labels))
    else:
        train_rows, test_rows = held_out(labels, params["eval_fraction"])
        test_payloads, test_labels = payloads, labels
    on_error = params["on_error"]
    splits = []
    for source, source_labels, rows, how in (
        (payloads, labels, train_rows, params["augment"]),
        (test_payloads, test_labels, test_rows, Augment.none),
    ):
        subset = Subset(source, rows)
        kept = readable(subset, on_error, f"data.path={params['path']}")
        splits.append(
            ImageExamples(
                Subset(subset, kept),
                source_labels[rows][kept],
                params["image_size"],
                params["channels"],
                how,
            )
        )
    files = train_files + (val_files or [])
    return image_splits(*splits, params["normalize"], params["workers"], fingerprint(files))


def _describe(fmt: str, suffix: str):
    def describe(**params: Any) -> dict[str, Any]:
        check_image_keys(**params)
        size, channels = params.get("image_size", 32), params.get("channels", 3)
        num_classes = params.get("num_classes")
        if num_classes is None:
            train_files, _ = split_files(params.get("path"), suffix, fmt)
            columns = params.get("image_column", "image"), params.get("label_column", "label")
            _, values = _labelled(fmt, train_files, *columns)
            classes = class_list(values)
            labels = label_array(values, classes, f"data.path={params.get('path')}")
            num_classes = len(classes) if classes else int(labels.max()) + 1 if len(labels) else 0
        return {"input_shape": (size, size, channels), "num_classes": num_classes}

    return describe


def _loader(fmt: str, suffix: str, what: str):
    """The loader of one of the two formats: the same keys, its own files."""

    def load(
        path: str | None = None,
        image_column: str = "image",
        label_column: str = "label",
        num_classes: int | None = None,
        image_size: int = 32,
        channels: int = 3,
        augment: Augment = Augment.basic,
        normalize: NormalizeBy = NormalizeBy.dataset,
        eval_fraction: float = 0.1,
        workers: int = 0,
        on_error: OnError = OnError.skip,
    ) -> Splits:
        params = {k: v for k, v in locals().items() if k not in ("fmt", "suffix")}
        return _tables(fmt, suffix, params)

    load.__name__ = load.__qualname__ = fmt
    load.__doc__ = (
        f"Labelled images in {what} (see the module's doc); the other keys are those of "
        "`data=images`. `num_classes` unset: the number of class names, or the largest label + 1."
    )
    return register_data(fmt, describe=_describe(fmt, suffix))(load)


arrayrecord = _loader("arrayrecord", ARRAY_RECORD, "ArrayRecord shards")
parquet = _loader("parquet", PARQUET, "Parquet files")

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
  images are small); for data larger than memory, convert it to ArrayRecord. The layout of
  Hugging Face `datasets` is read too: an image column of `Image()` structs of `bytes` and
  `path` (the bytes read where they are set; where they are null, the image file at `path`,
  absolute or relative to the Parquet file's folder, a missing one refused by row and path),
  and a `ClassLabel` label column, whose class names (from the schema's `huggingface`
  metadata) name labels 0, 1, ... and count the classes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np
from zoo.data.image_examples import Augment, Subset, readable
from zoo.data.image_options import ImageOptions, held_out, image_splits

from zoo.plugin import Splits, ZooError, register_data

if TYPE_CHECKING:  # pyarrow and Grain are imported where Parquet and ArrayRecord files are read
    import pyarrow as pa

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


def _check_num_classes(num_classes: int | None) -> None:
    if num_classes is not None and num_classes < 1:
        raise ZooError(
            f"data.num_classes={num_classes} must be at least 1, or null to count the classes "
            "(the class names, or the largest label + 1)."
        )


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
        import grain

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
    """The image column of Parquet files, in memory: each row's encoded bytes or uint8 pixels,
    or, for a Hugging Face image without its bytes, the path of its file (`paths`)."""

    def __init__(self, column: pa.ChunkedArray, paths: dict[int, str], files: list[str]):
        self.column, self.paths, self.files = column.combine_chunks(), paths, files

    def __len__(self) -> int:
        return len(self.column)

    def read(self, index: int) -> bytes | np.ndarray | str:
        if index in self.paths:
            return self.paths[index]
        return _pixels_or_bytes(self.column[index].as_py())

    def name(self, index: int) -> str:
        return f"row {index} of {', '.join(self.files)}"


def _pixels_or_bytes(value: Any) -> bytes | np.ndarray:
    """A cell as an image payload; a null one as no bytes, which `data.on_error` handles as
    any image that cannot be decoded."""
    if value is None:
        return b""
    return value if isinstance(value, bytes) else np.asarray(value, np.uint8)


def read_parquet(
    files: list[str], columns: Sequence[str], where: str
) -> tuple[Rows, list[Any], list[str] | None]:
    """(the image column, the label values, the label column's class names or None) of the
    Parquet files, in order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    image_column, label_column = columns
    cells, paths, values, names = [], {}, [], None
    for i, file in enumerate(files):
        schema = pq.read_schema(file)
        missing = [c for c in columns if c not in schema.names]
        if missing:
            raise ZooError(
                f"{where}: {file} has no column(s) {', '.join(missing)}; its columns are "
                f"{', '.join(schema.names)}. Set data.image_column and data.label_column to them."
            )
        table = pq.read_table(file, columns=list(columns))
        images = table[image_column]
        if pa.types.is_struct(images.type):
            images, found = _image_structs(images, file, image_column)
            paths.update({len(values) + row: path for row, path in found.items()})
        cells += images.chunks
        values += table[label_column].to_pylist()
        file_names = class_label_names(schema, label_column)
        if i and file_names != names:
            raise ZooError(
                f"{where}: {file} names the classes of '{label_column}' {file_names}, but "
                f"{files[0]} names them {names}. Give files of one data set."
            )
        names = file_names
    try:
        column = pa.chunked_array(cells, type=cells[0].type if cells else pa.binary())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        raise ZooError(
            f"{where}: the column '{image_column}' has different types in {', '.join(files)}. "
            "Give files of one layout."
        ) from None
    return Rows(column, paths, files), values, names


def _image_structs(
    column: pa.ChunkedArray, file: str, name: str
) -> tuple[pa.ChunkedArray, dict[int, str]]:
    """A Hugging Face `Image()` column: its `bytes`, and the image files of the rows whose
    bytes are null and whose `path` is set (absolute, or relative to the Parquet file's
    folder)."""
    import pyarrow.compute as pc

    fields = [column.type.field(i).name for i in range(column.type.num_fields)]
    if "bytes" not in fields:
        raise ZooError(
            f"{file}: data.image_column='{name}' holds structs of {', '.join(fields)}. zoo reads "
            "encoded image bytes, arrays of uint8 pixels, or the struct of bytes and path that "
            "Hugging Face datasets' Image() feature writes. Set data.image_column to such a "
            "column."
        )
    data = pc.struct_field(column, "bytes")
    if "path" not in fields or not data.null_count:
        return data, {}
    written = pc.struct_field(column, "path").to_pylist()
    folder = os.path.dirname(os.path.abspath(file))
    found, missing = {}, []
    for row in np.flatnonzero(data.is_null().to_numpy(zero_copy_only=False)):
        if written[row] is None:
            continue  # no image at all: as a cell that cannot be decoded
        path = os.path.join(folder, written[row])
        if os.path.isfile(path):
            found[int(row)] = path
        else:
            missing.append(row)
    if missing:
        rows = ", ".join(f"{row} ({written[row]})" for row in missing[:5])
        raise ZooError(
            f"{file}: {len(missing)} row(s) of data.image_column='{name}' hold no image bytes, "
            f"only the path of a file that does not exist, e.g. rows {rows}; a relative path is "
            f"read from the Parquet file's folder, {folder}. Put the images there, or write "
            "the file with the images' bytes in it."
        )
    return data, found


def class_label_names(schema: pa.Schema, column: str) -> list[str] | None:
    """The class names of a Hugging Face `ClassLabel` column, from the schema's `huggingface`
    metadata; None where the column is not one."""
    try:
        info = json.loads((schema.metadata or {})[b"huggingface"])
        feature = info["info"]["features"][column]
    except (KeyError, TypeError, ValueError):
        return None
    if not isinstance(feature, dict) or feature.get("_type") != "ClassLabel":
        return None
    names = feature.get("names")
    return [str(name) for name in names] if isinstance(names, list) else None


# ---- The data sets ----


def _labelled(
    fmt: str, files: list[str], columns: Sequence[str], where: str, known: list[str] | None = None
) -> tuple[Records | Rows, np.ndarray, list[str] | None]:
    """(payloads, integer labels, class names or None) of some files of format `fmt`. Labels
    that are names are numbered in the sorted order of the names, or of `known` (the training
    split's classes, for its eval split); a Hugging Face ClassLabel's integers are named by
    its metadata."""
    image_column, label_column = columns
    if fmt == "arrayrecord":
        payloads = Records(files, image_column)
        values, names = payloads.columns(label_column, f"data={fmt} data.path"), None
    else:
        payloads, values, names = read_parquet(files, columns, f"data={fmt} data.path")
    named = class_list(values)
    if named is not None:
        classes = known if known is not None else named
        return payloads, label_array(values, classes, where), classes
    if known is not None and names is not None and names != known:
        raise ZooError(
            f"{where} names the classes of '{label_column}' {names}, but the training files "
            f"name them {known}. Give the splits of one data set."
        )
    return payloads, label_array(values, None, where), names


def _num_classes(given: int | None, labels: np.ndarray, classes: list[str] | None) -> int:
    """`data.num_classes`; unset: the number of class names, or the largest label + 1."""
    if given is not None:
        return given
    return len(classes) if classes else int(labels.max()) + 1 if len(labels) else 0


def _tables(
    fmt: str,
    suffix: str,
    path: str | None,
    columns: tuple[str, str],
    num_classes: int | None,
    options: ImageOptions,
) -> Splits:
    _check_num_classes(num_classes)
    where = f"data.path={path}"
    train_files, val_files = split_files(path, suffix, fmt)
    payloads, labels, classes = _labelled(fmt, train_files, columns, where)
    if not len(payloads):
        raise ZooError(f"data.path={path} holds no {fmt} examples.")
    num_classes = _num_classes(num_classes, labels, classes)
    check_labels(labels, num_classes, where, columns[1])
    if val_files is not None:
        val_where = ", ".join(val_files)
        test_payloads, test_labels, _ = _labelled(fmt, val_files, columns, val_where, classes)
        check_labels(test_labels, num_classes, val_where, columns[1])
        train_rows, test_rows = np.arange(len(labels)), np.arange(len(test_labels))
    else:
        train_rows, test_rows = held_out(labels, options.eval_fraction)
        test_payloads, test_labels = payloads, labels
    splits = []
    for source, source_labels, rows, how in (
        (payloads, labels, train_rows, options.augment),
        (test_payloads, test_labels, test_rows, Augment.none),
    ):
        subset = Subset(source, rows)
        kept = readable(subset, options.on_error, where)
        splits.append(options.examples(Subset(subset, kept), source_labels[rows][kept], how))
    return image_splits(*splits, options, train_files + (val_files or []), classes)


def _describe(fmt: str, suffix: str):
    def describe(**params: Any) -> dict[str, Any]:
        options = ImageOptions.of(params)
        num_classes = params.get("num_classes")
        _check_num_classes(num_classes)
        if num_classes is None:
            train_files, _ = split_files(params.get("path"), suffix, fmt)
            columns = params.get("image_column", "image"), params.get("label_column", "label")
            where = f"data.path={params.get('path')}"
            _, labels, classes = _labelled(fmt, train_files, columns, where)
            num_classes = _num_classes(None, labels, classes)
        return {"input_shape": options.input_shape, "num_classes": num_classes}

    return describe


def _loader(fmt: str, suffix: str, what: str):
    """The loader of one of the two formats: the same keys, its own files."""

    def load(
        # A file of the format, a folder of them, or a folder with `train/` and `val/` folders of
        # them (required).
        path: str | None = None,
        # The column of images: encoded bytes, uint8 pixels (H x W or H x W x C) or Hugging Face
        # `Image()` structs of bytes and path.
        image_column: str = "image",
        # The column of labels: integers 0..num_classes-1, class names (sorted into labels) or a
        # Hugging Face `ClassLabel`.
        label_column: str = "label",
        # Classes; null: the number of class names (a ClassLabel's, or those the labels are), or the
        # largest label + 1.
        num_classes: int | None = None,
        *,
        options: ImageOptions,
    ) -> Splits:
        columns = image_column, label_column
        return _tables(fmt, suffix, path, columns, num_classes, options)

    load.__name__ = load.__qualname__ = fmt
    load.__doc__ = (
        f"Labelled images in {what} (see the module's doc); the other keys are those of "
        "`data=images`. `num_classes` unset: the number of class names (a ClassLabel's, or "
        "those the labels are), or the largest label + 1."
    )
    return register_data(fmt, describe=_describe(fmt, suffix))(load)


arrayrecord = _loader("arrayrecord", ARRAY_RECORD, "ArrayRecord shards")
parquet = _loader("parquet", PARQUET, "Parquet files")

"""Conversations read from JSON Lines and Parquet files, each row checked and named.

A row holds either a conversation, a list of `{role, content}` messages (the `messages` column),
or a prompt and its completion (the `prompt` and `completion` columns), each text (the prompt a
user's message, the completion the assistant's reply) or a list of messages. Column names are
settings. A row that cannot be a conversation is a `Row` with a `problem` and a name
(`file:line` for JSON Lines, `file row N` for Parquet), which `data.on_error` skips or refuses:
a missing or unknown role, an empty conversation, content that is not text. Other data sets of
messages (`data=preference`) read their rows with the same files, names and checks, and their
own columns (`ColumnNames`) and `Parse`.

`data.path` is a file, a folder of them (`*.jsonl`, `*.json` as JSON Lines, `*.parquet`, in
subfolders too) or a folder with `train/` and `val/` folders of them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np
from zoo.data.files import cache_root, write_atomically

from zoo.plugin import ZooError

JSON_LINES, PARQUET = (".jsonl", ".json"), ".parquet"
SUFFIXES = (*JSON_LINES, PARQUET)
DEFAULT_ROLES = ("system", "user", "assistant", "tool")
ASSISTANT = "assistant"


@dataclasses.dataclass(frozen=True)
class RowKind:
    """How messages name a data set of rows like these and each of its rows."""

    data_set: str
    """The setting that picks it: `data=chat`."""
    row: str
    """What a row holds: a `conversation`; its plural adds an `s`."""
    too_long: str
    """What to do when no row has a reply within the largest of `data.buckets`."""


CONVERSATIONS = RowKind(
    "data=chat",
    "conversation",
    "use larger data.buckets (within the model's context), or check data.loss_on",
)


class ColumnNames(Protocol):
    """The names of the columns a data set of rows reads (a dataclass of them)."""

    kind: ClassVar[RowKind]

    @property
    def names(self) -> tuple[str, ...]: ...

    def described(self) -> str: ...


@dataclasses.dataclass(frozen=True)
class Columns:
    """The column names of a row's conversation, or of its prompt and completion."""

    kind: ClassVar[RowKind] = CONVERSATIONS
    messages: str = "messages"
    prompt: str = "prompt"
    completion: str = "completion"

    @property
    def names(self) -> tuple[str, ...]:
        return self.messages, self.prompt, self.completion

    def described(self) -> str:
        return f"'{self.messages}', or '{self.prompt}' and '{self.completion}'"


@dataclasses.dataclass(frozen=True)
class Conversation:
    """Messages to render; `prompt`: for a prompt and completion, how many of the messages are
    the prompt (the rest are the completion); None for a conversation."""

    messages: tuple[dict[str, Any], ...]
    prompt: int | None = None


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of a file: its conversation (what `read_rows`' `parse` made of it: a
    `Conversation`, or a data set's own example of them), or what is wrong with it."""

    where: str
    conversation: Conversation | Any = None
    problem: str | None = None


def conversation_files(
    path: str | None, kind: RowKind = CONVERSATIONS
) -> tuple[list[Path], list[Path] | None]:
    """(training files, held-out files or None) that `data.path` names."""
    root = Path(path).expanduser() if path is not None else None
    if root is None or not root.exists():
        raise ZooError(
            f"data.path={path} does not exist: {kind.data_set} needs data.path naming a JSON "
            f"Lines ({', '.join(JSON_LINES)}) or Parquet file of {kind.row}s, a folder of them, "
            "or a folder with train/ and val/ folders of them."
        )
    if root.is_file():
        return [root], None
    if (root / "train").is_dir() and (root / "val").is_dir():
        return _files(root / "train", kind), _files(root / "val", kind)
    return _files(root, kind), None


def _files(folder: Path, kind: RowKind) -> list[Path]:
    found = sorted(p for p in folder.rglob("*") if p.suffix in SUFFIXES and p.is_file())
    if not found:
        raise ZooError(
            f"{folder} holds no {kind.row} files: {kind.data_set} reads "
            f"{', '.join(SUFFIXES)} files (in subfolders too)."
        )
    return found


Parse = Callable[[Any, Any, Sequence[str]], Any]
"""What a data set makes of a row: (record, its `ColumnNames`, data.roles) -> a `Conversation`
(`conversation`) or another example of messages; `BadRow` names what is wrong with it."""


def read_rows(
    file: Path,
    columns: ColumnNames,
    roles: Sequence[str],
    parse: Parse | None = None,
    every_column: bool = False,
) -> list[Row]:
    """Every row of `file`, checked (by `parse`, `conversation` unless given); a `ZooError` for
    a file that holds none of the columns. A Parquet file's other columns are read only with
    `every_column` (a JSON Lines row holds all of its own)."""
    if file.suffix == PARQUET:
        records = list(_parquet_records(file, columns, every_column))
    else:
        records = list(_lines(file))
    wanted = set(columns.names)
    if records and not any(isinstance(r, Mapping) and wanted & r.keys() for _, r in records):
        found = sorted({k for _, r in records if isinstance(r, Mapping) for k in r})
        raise ZooError(
            f"{file} holds no column {columns.kind.data_set} reads: it reads "
            f"{columns.described()} ({_settings(columns)} name them), and the rows have "
            f"{', '.join(map(repr, found[:20])) or 'no columns'}."
        )
    return [_row(where, record, columns, roles, parse or conversation) for where, record in records]


def _settings(columns: ColumnNames) -> str:
    """The settings that name `columns`' columns: `data.messages, data.prompt, ...`."""
    return ", ".join(f"data.{field.name}" for field in dataclasses.fields(columns))


def _lines(file: Path) -> Iterator[tuple[str, Any]]:
    with open(file, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{file}:{number}", json.loads(line)
            except json.JSONDecodeError as e:
                yield f"{file}:{number}", _NotJson(str(e))


def _parquet_records(
    file: Path, columns: ColumnNames, every_column: bool
) -> Iterator[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(file).names
        wanted = [c for c in columns.names if c in names]
        records = pq.read_table(file, columns=names if every_column else wanted).to_pylist()
    except OSError as e:
        raise ZooError(f"{file} is not a Parquet file that can be read: {e}.") from None
    if not wanted:
        raise ZooError(
            f"{file} holds no column {columns.kind.data_set} reads: it reads "
            f"{columns.described()} ({_settings(columns)} name them), and its columns are "
            f"{', '.join(map(repr, names[:20]))}."
        )
    for index, record in enumerate(records):
        yield f"{file} row {index}", record


@dataclasses.dataclass(frozen=True)
class _NotJson:
    reason: str


class BadRow(Exception):
    """What is wrong with a row (`Row.problem`): `... has an empty 'prompt'`."""


def _row(where: str, record: Any, columns: ColumnNames, roles: Sequence[str], parse: Parse) -> Row:
    try:
        return Row(where, parse(record, columns, roles))
    except BadRow as e:
        return Row(where, problem=str(e))


def columns_of(record: Any) -> Mapping[str, Any]:
    """A row's columns; `BadRow` for a line that is not JSON or not an object."""
    if isinstance(record, _NotJson):
        raise BadRow(f"is not JSON ({record.reason})")
    if not isinstance(record, Mapping):
        raise BadRow(f"is a {type(record).__name__}, not an object of columns")
    return record


def conversation(record: Any, columns: Columns, roles: Sequence[str]) -> Conversation:
    """The conversation of one row; `BadRow` names what is wrong with it."""
    record = columns_of(record)
    if record.get(columns.messages) is not None:
        return Conversation(_messages(record[columns.messages], columns.messages, roles))
    prompt, completion = record.get(columns.prompt), record.get(columns.completion)
    if prompt is None or completion is None:
        raise BadRow(f"has neither {columns.described()}")
    asked = part(prompt, columns.prompt, "user", roles)
    answered = part(completion, columns.completion, ASSISTANT, roles)
    return Conversation((*asked, *answered), prompt=len(asked))


def part(value: Any, column: str, role: str, roles: Sequence[str]) -> tuple[dict, ...]:
    """A prompt or completion: text (one message of `role`) or a list of messages (each
    checked: a role of `roles`, content); `BadRow` names what is wrong with it."""
    if isinstance(value, str):
        if not value:
            raise BadRow(f"has an empty '{column}'")
        return ({"role": role, "content": value},)
    return _messages(value, column, roles)


def _messages(value: Any, column: str, roles: Sequence[str]) -> tuple[dict, ...]:
    if not isinstance(value, list):
        raise BadRow(f"has a '{column}' that is a {type(value).__name__}, not a list of messages")
    if not value:
        raise BadRow(f"has an empty conversation ('{column}' is [])")
    return tuple(_message(m, f"'{column}'[{i}]", roles) for i, m in enumerate(value))


def _message(message: Any, where: str, roles: Sequence[str]) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise BadRow(f"has {where} that is a {type(message).__name__}, not a message")
    role, content = message.get("role"), message.get("content")
    if role is None or role == "":
        raise BadRow(f"has {where} without a role")
    if role not in roles:
        raise BadRow(
            f"has {where} with the role {role!r}, not one of {', '.join(roles)} (data.roles)"
        )
    if content is None and not message.get("tool_calls"):
        raise BadRow(f"has {where} without content")
    if content is not None and not isinstance(content, str | list | dict):
        raise BadRow(f"has {where} whose content is a {type(content).__name__}, not text")
    return {key: value for key, value in message.items() if value is not None}


_ROW = re.compile(r"(:\d+| row \d+)$")
"""The end of a row's name that says which row of its file it is (`_lines`, `_parquet_records`)."""


def split_names(wheres: Sequence[str], file: Path, root: Path) -> list[str]:
    """`file`'s rows named for the held-out draw by the file's path within `root` (its name when
    `root` is the file) and the row's line or index: the same split wherever the data lies and
    however `data.path` spells it."""
    name = file.name if file == root else file.relative_to(root).as_posix()
    return [name + _ROW.search(w).group() for w in wheres]


def held_out(wheres: Sequence[str], fraction: float) -> np.ndarray:
    """Which rows (by name) are held out: those whose name's CRC-32 falls in the lowest
    `fraction`, so a row stays on its side when files are added; at least one on each side."""
    draws = np.array([zlib.crc32(w.encode()) / 2**32 for w in wheres])
    out = draws < fraction
    if len(draws) > 1 and not out.any():
        out[np.argmin(draws)] = True
    if len(draws) > 1 and out.all():
        out[np.argmax(draws)] = False
    return out


def write_conversations(rows: Sequence[Any], columns: Columns = Columns()) -> Path:
    """A JSON Lines file in the data cache holding `rows` (conversations given from Python:
    each a list of messages or a row of columns), named by its content, so that the same
    conversations are the same file and a run on them resumes."""
    if isinstance(rows, str | bytes | Mapping) or not isinstance(rows, Sequence):
        raise ZooError(
            f"Conversations are a list (one item per conversation), not a {type(rows).__name__}: "
            "each item a list of {'role', 'content'} messages, or a dict with "
            f"{columns.described()}."
        )
    lines = []
    for index, row in enumerate(rows):
        record = {columns.messages: row} if isinstance(row, list | tuple) else row
        try:
            lines.append(json.dumps(record, ensure_ascii=False, sort_keys=True))
        except (TypeError, ValueError) as e:
            raise ZooError(
                f"Conversation {index} holds something that is not JSON ({e}): messages hold "
                "text, numbers, lists and dicts."
            ) from None
    text = "".join(line + "\n" for line in lines).encode()
    target = cache_root() / "conversations" / f"{hashlib.sha256(text).hexdigest()[:32]}.jsonl"
    if not target.is_file():
        write_atomically(target, lambda f: f.write(text))
    return target

"""`data=chat data.path=...`: conversations for fine-tuning a chat model on its replies.

The files (`zoo.data.conversations`: JSON Lines or Parquet, of `messages` or of `prompt` and
`completion`) are rendered with the checkpoint's chat template and tokenised
(`zoo.data.chat_tokens`), with a mask of the tokens that carry loss (`data.loss_on`: the
assistant's turns, the completion, or all). `finetune.init_from=DIR` gives `data.tokenizer` the
checkpoint's tokenizer; the template is read from the tokenizer's directory unless
`data.template` names another.

Each file is tokenised once and cached in the data cache (`ZOO_DATA_DIR`), under a hash of
everything its ids and masks depend on: the file's path, size and modification time, the
tokenizer's bytes, the template and its special tokens, the columns, roles and `loss_on`.

Rows that are no conversation (a message without a role or with a role not in `data.roles`, an
empty conversation, a template's refusal, no reply to train on) are named: `data.on_error=skip`
leaves them out with a warning each, `raise` stops before training, naming them all.

Every split holds `tokens` (int32, N x (L + 1)), `length` (the real targets of each row) and
`loss_mask` (uint8, N x L: 1 where the target carries loss). A batch is padded to the smallest of
`data.buckets` that holds its longest conversation (as text's `lines` mode is); a longer one is
cut to the largest bucket, and one left with no token that carries loss is skipped, said in a
warning. Held out: `train/` and `val/` folders, else `data.eval_fraction` of the rows, chosen by
the CRC-32 of each row's name (file and line), so that a row stays on its side as files are
added.

`data.packing=true` packs the training conversations several to a row instead
(`zoo.data.packing`), with `segment_ids` and `positions` columns that a decoder reads to keep
each conversation's attention and positions its own; the held-out ones stay one to a row.

The keys that `data=preference` and `data=prompts` share with it (the tokenizer and template,
roles, buckets, held-out share, bad rows, eval replies) are `zoo.data.chat_options.ChatOptions`.
`data=preference` (`zoo.data.preference`) reads, caches, splits and pads its pairs with the
same parts (`Reader`, `held_out_split`, `trainable_rows`, `ChatPadding`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
from zoo.data.chat_options import ChatOptions
from zoo.data.chat_prompts import held_out_prompts
from zoo.data.chat_tokens import Encoder, LossOn, RowProblem
from zoo.data.conversations import (
    CONVERSATIONS,
    ColumnNames,
    Columns,
    Row,
    RowKind,
    conversation_files,
    held_out,
    read_rows,
    split_names,
)
from zoo.data.files import cache_root, write_atomically
from zoo.data.image_examples import RAISE, OnError
from zoo.data.packing import pack, packed_rows
from zoo.data.text import LENGTH, TOKENS, BucketPadding

from zoo.plugin import (
    LOSS_MASK,
    POSITIONS,
    SEGMENT_IDS,
    Batch,
    ExampleSource,
    Splits,
    ZooError,
    register_data,
)

log = logging.getLogger("zoo")

FORMAT = "zoo-chat-1"
"""Part of every cache entry's hash: a change to how entries are made changes this."""
SHOWN = 10
"""Bad rows named in a refusal."""


@dataclasses.dataclass(frozen=True)
class Encoded:
    """Tokenised conversations, end to end: conversation i is `ids[starts[i]:starts[i + 1]]`."""

    ids: np.ndarray
    trained: np.ndarray
    starts: np.ndarray
    wheres: list[str]
    problems: list[tuple[str, str]]

    def __len__(self) -> int:
        return len(self.wheres)

    @classmethod
    def made(
        cls,
        ids: Sequence[np.ndarray],
        trained: Sequence[np.ndarray],
        wheres: list[str],
        problems: list[tuple[str, str]],
    ) -> Encoded:
        """The conversations of `ids` and `trained` (one array of each per conversation)."""
        starts = np.cumsum([0] + [len(i) for i in ids]).astype(np.int64)
        return cls(
            np.concatenate([*ids, np.empty(0, np.int32)]).astype(np.int32),
            np.concatenate([*trained, np.empty(0, np.uint8)]).astype(np.uint8),
            starts,
            wheres,
            problems,
        )

    @classmethod
    def joined(cls, parts: Sequence[Encoded]) -> Encoded:
        """The conversations of `parts`, one after another."""
        sizes = np.cumsum([0] + [len(p.ids) for p in parts[:-1]])
        return cls(
            np.concatenate([p.ids for p in parts]),
            np.concatenate([p.trained for p in parts]),
            np.concatenate([[0]] + [p.starts[1:] + size for p, size in zip(parts, sizes)]),
            [w for p in parts for w in p.wheres],
            [problem for p in parts for problem in p.problems],
        )

    def stored(self, prefix: str = "") -> dict[str, np.ndarray]:
        """The arrays a cache entry holds, named `prefix` + `ids`, ..."""
        arrays = {
            "ids": self.ids,
            "trained": self.trained,
            "starts": self.starts,
            "wheres": np.asarray(self.wheres, dtype=str),
            "problems": np.asarray(json.dumps(self.problems)),
        }
        return {prefix + name: array for name, array in arrays.items()}

    @classmethod
    def loaded(cls, stored: Any, prefix: str = "") -> Encoded:
        """The conversations a cache entry's arrays (`stored`) hold."""
        return cls(
            stored[prefix + "ids"],
            stored[prefix + "trained"],
            stored[prefix + "starts"],
            stored[prefix + "wheres"].tolist(),
            [tuple(p) for p in json.loads(str(stored[prefix + "problems"]))],
        )

    def trains(self, row: int, longest: int) -> bool:
        """Whether a target of conversation `row` within the first `longest` carries loss."""
        start, end = self.starts[row], self.starts[row + 1]
        return bool(self.trained[start + 1 : min(end, start + longest + 1)].any())


class ChatExamples(ExampleSource):
    """Some conversations of an `Encoded`, each cut to `longest` targets and padded."""

    def __init__(self, encoded: Encoded, rows: np.ndarray, longest: int):
        self.encoded, self.rows, self.longest = encoded, np.asarray(rows, np.int64), longest

    def __len__(self) -> int:
        return len(self.rows)

    def examples(self, rows: np.ndarray, epochs: np.ndarray | None, seed: int) -> Batch:
        tokens = np.zeros((len(rows), self.longest + 1), np.int32)
        trained = np.zeros((len(rows), self.longest + 1), np.uint8)
        for i, row in enumerate(self.rows[rows]):
            ids, marks = self.piece(row)
            tokens[i, : len(ids)], trained[i, : len(ids)] = ids, marks
        lengths = np.minimum(np.diff(self.encoded.starts)[self.rows[rows]], self.longest + 1) - 1
        return {TOKENS: tokens, LENGTH: lengths.astype(np.int32), LOSS_MASK: trained[:, 1:]}

    def piece(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        """Conversation `row`'s ids and loss marks, cut to `longest` targets."""
        start, end = self.encoded.starts[row], self.encoded.starts[row + 1]
        end = min(end, start + self.longest + 1)
        return self.encoded.ids[start:end], self.encoded.trained[start:end]


class PackedChatExamples(ChatExamples):
    """The conversations packed several to a row (`zoo.data.packing`): an example is a row."""

    def __init__(self, encoded: Encoded, rows: np.ndarray, longest: int):
        super().__init__(encoded, rows, longest)
        sizes = np.minimum(np.diff(encoded.starts)[self.rows], longest + 1)
        self.packs = packed_rows(sizes, longest + 1)

    def __len__(self) -> int:
        return len(self.packs)

    def examples(self, rows: np.ndarray, epochs: np.ndarray | None, seed: int) -> Batch:
        return pack([[self.piece(self.rows[i]) for i in self.packs[r]] for r in rows], self.longest)


class ChatPadding(BucketPadding):
    """Text's bucket padding, with the loss mask (and a packed row's segments and positions)
    cut as the tokens are; the rows may have more axes (a preference pair's two sequences), the
    bucket the smallest that holds the longest of all."""

    def __call__(self, batch: Batch) -> Batch:
        tokens, lengths = batch[TOKENS], batch[LENGTH]
        flat = {TOKENS: tokens.reshape(-1, tokens.shape[-1]), LENGTH: lengths.reshape(-1)}
        cut = super().__call__(flat)[TOKENS].shape[-1] - 1
        per_target = (c for c in (LOSS_MASK, SEGMENT_IDS, POSITIONS) if c in batch)
        return {TOKENS: tokens[..., : cut + 1], **{c: batch[c][..., :cut] for c in per_target}}


def cached_arrays(
    file: Path, settings: bytes, folder: str, make: Callable[[], dict[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    """The arrays made of `file` (by `make`), from the data cache's `folder`, or made into it
    first; `settings`: the hash of everything else they depend on (the maker's format tag
    first), the file's path, size and modification time added."""
    info = file.stat()
    digest = hashlib.sha256(settings)
    digest.update(f"{file.resolve()}\0{info.st_size}\0{info.st_mtime_ns}".encode())
    target = cache_root() / folder / f"{digest.hexdigest()[:32]}.npz"
    if not target.is_file():
        write_atomically(target, lambda f: np.savez(f, **make()))
    with np.load(target) as stored:
        return {name: stored[name] for name in stored.files}


def encoded_file(
    file: Path, encoder: Encoder, settings: bytes, columns: Columns, roles: Sequence[str]
) -> Encoded:
    """`file`'s conversations tokenised, from the cache, or tokenised into it first;
    `settings`: the hash of everything else the entry depends on (`cache_settings`)."""

    def make() -> dict[str, np.ndarray]:
        return _encode_rows(read_rows(file, columns, roles), encoder).stored()

    return Encoded.loaded(cached_arrays(file, FORMAT.encode() + settings, "chat", make))


def _encode_rows(rows: Sequence[Row], encoder: Encoder) -> Encoded:
    ids, trained, wheres, problems = [], [], [], []
    for row in rows:
        if row.problem is not None:
            problems.append((row.where, row.problem))
            continue
        try:
            row_ids, row_trained = encoder.encode(row.conversation)
        except RowProblem as e:
            problems.append((row.where, str(e)))
            continue
        ids.append(row_ids)
        trained.append(row_trained)
        wheres.append(row.where)
    return Encoded.made(ids, trained, wheres, problems)


class Rows(Protocol):
    """Tokenised rows of files (`Encoded` conversations, or a data set's own examples): each
    good row's name, each bad row's name and problem."""

    @property
    def wheres(self) -> list[str]: ...

    @property
    def problems(self) -> list[tuple[str, str]]: ...

    def __len__(self) -> int: ...

    @classmethod
    def joined(cls, parts: Sequence[Any]) -> Any: ...


class TrainableRows(Rows, Protocol):
    """Rows whose targets carry loss where they are marked (`Encoded`, a data set's pairs)."""

    def trains(self, row: int, longest: int) -> bool: ...


def handle_problems(
    encoded: Rows, on_error: OnError, where: str, kind: RowKind = CONVERSATIONS
) -> None:
    """`data.on_error` for the rows that are no conversation (`kind.row`): warned about, or
    refused."""
    bad = encoded.problems
    if bad and on_error == RAISE:
        named = "; ".join(f"{w} {problem}" for w, problem in bad[:SHOWN])
        raise ZooError(
            f"{len(bad)} of the {len(bad) + len(encoded):,} rows of {where} are no {kind.row} "
            f"to train on (data.on_error=raise): {named}{'; ...' if len(bad) > SHOWN else ''}. "
            "Fix or remove them, or let data.on_error=skip leave them out."
        )
    for w, problem in bad:
        log.warning("Skipping %s: it %s.", w, problem)
    if bad:
        log.warning(
            "Skipped %d of the %d rows of %s that are no %s to train on.",
            len(bad),
            len(bad) + len(encoded),
            where,
            kind.row,
        )


def trainable_rows(
    encoded: TrainableRows, rows: np.ndarray, longest: int, what: str, kind: RowKind = CONVERSATIONS
) -> np.ndarray:
    """`rows` less those with no target that carries loss within `longest` targets (`trains`),
    said."""
    kept = np.asarray([r for r in rows if encoded.trains(int(r), longest)], np.int64)
    cut = np.setdiff1d(rows, kept)
    if len(cut):
        log.warning(
            "Skipped %d of the %d %s %ss: no token that carries loss is among their "
            "first %d (the largest of data.buckets + 1); the first of them: %s.",
            len(cut),
            len(rows),
            what,
            kind.row,
            longest + 1,
            encoded.wheres[cut[0]],
        )
    if not len(kept):
        raise ZooError(
            f"No {what} {kind.row} has a token that carries loss within its first "
            f"{longest + 1} tokens: {kind.too_long}."
        )
    return kept


def cache_settings(
    tokenizer: Path, encoder: Encoder, columns: ColumnNames, roles: Sequence[str]
) -> bytes:
    """Everything besides the file that a cache entry's ids and masks depend on."""
    described = {
        "template": encoder.template.template,
        "tokens": encoder.template.tokens,
        "end_of_turn": encoder.end_of_turn,
        "loss_on": encoder.loss_on.value,
        "columns": dataclasses.asdict(columns),
        "roles": list(roles),
        "template_kwargs": encoder.template_kwargs,
    }
    digest = hashlib.sha256(tokenizer.read_bytes())
    digest.update(json.dumps(described, sort_keys=True).encode())
    return digest.digest()


@register_data("chat")
def chat(
    # A JSON Lines (`.jsonl`, `.json`) or Parquet file of conversations, a folder of them, or a
    # folder with `train/` and `val/` folders of them (required).
    path: str | None = None,
    messages: str = "messages",  # the column of conversations: lists of {role, content}
    prompt: str = "prompt",  # the column of prompts: text (a user's message) or messages
    completion: str = "completion",  # the column of completions: text (the reply) or messages
    # Tokens that carry loss: `assistant` (every reply), `completion` (the last reply), `all`.
    loss_on: LossOn = LossOn.assistant,
    # Training rows of several conversations end to end (the largest bucket long), attention and
    # positions kept within each (a decoder only): less padding, more tokens per step.
    packing: bool = False,
    *,
    options: ChatOptions,
) -> Splits:
    """Conversations (or prompts and completions) rendered with a checkpoint's chat template,
    with a loss mask over the replies (see the module's doc)."""
    file, encoder = options.encoder(loss_on)
    columns = Columns(messages, prompt, completion)
    roles = options.roles
    settings = cache_settings(file, encoder, columns, roles)
    load = functools.partial(
        encoded_file, encoder=encoder, settings=settings, columns=columns, roles=roles
    )
    train_files, val_files = conversation_files(path)
    train, train_rows, test, test_rows = held_out_split(
        Reader(path, load), train_files, val_files, options
    )
    longest = max(options.buckets)
    held = trainable_rows(test, test_rows, longest, "held-out")
    trained = trainable_rows(train, train_rows, longest, "training")
    return Splits(
        train=(PackedChatExamples if packing else ChatExamples)(train, trained, longest),
        eval=ChatExamples(test, held, longest),
        transform=ChatPadding(list(options.buckets)),
        tokenizer=encoder.tokenizer,
        prompts=held_out_prompts(
            [test.wheres[r] for r in held],
            val_files or train_files,
            encoder,
            columns,
            options,
            longest,
        ),
    )


E = TypeVar("E", bound=Rows)


@dataclasses.dataclass(frozen=True)
class Reader(Generic[E]):
    """How a data set reads the files under `path`: `load` tokenises each (or takes it from the
    cache) into `Rows`, which `joined` puts end to end."""

    path: str | None  # data.path; `read` is given files found under it
    load: Callable[[Path], E]
    kind: RowKind = CONVERSATIONS

    def read(self, files: list[Path], on_error: OnError) -> tuple[E, list[str]]:
        """The rows of `files`, end to end, their bad rows handled by `on_error`, and each one's
        name (file and line: what `held_out` chooses by)."""
        parts = [self.load(f) for f in files]
        encoded = type(parts[0]).joined(parts)
        handle_problems(encoded, on_error, f"data.path={self.path}", self.kind)
        root = Path(self.path).expanduser()
        return encoded, [n for f, p in zip(files, parts) for n in split_names(p.wheres, f, root)]


def held_out_split(
    reader: Reader[E],
    train_files: list[Path],
    val_files: list[Path] | None,
    options: ChatOptions,
) -> tuple[E, np.ndarray, E, np.ndarray]:
    """The training rows (conversations) and their indices, and the held-out ones and theirs:
    those of `val_files`, or without them `data.eval_fraction` of the training files' rows (by
    name); bad rows handled by `data.on_error`."""
    train, names = reader.read(train_files, options.on_error)
    if val_files is None:
        out = held_out(names, options.eval_fraction)
        test, train_rows, test_rows = train, np.flatnonzero(~out), np.flatnonzero(out)
    else:
        test, _ = reader.read(val_files, options.on_error)
        train_rows, test_rows = np.arange(len(train)), np.arange(len(test))
    if not len(train_rows) or not len(test_rows):
        row = reader.kind.row
        raise ZooError(
            f"data.path={reader.path} leaves {len(train_rows)} training and {len(test_rows)} "
            f"held-out {row}s: {reader.kind.data_set} needs at least one of each (two {row}s or "
            "more)."
        )
    return train, train_rows, test, test_rows

"""`data=prompts data.path=...`: prompts for reward fine-tuning (`finetune.method=grpo`), each
with the columns its reward functions read (`answer`, ...).

A row (JSON Lines or Parquet, as TRL and Hugging Face `datasets` hold them; the prompt's column
is `data.prompt`) is `{"prompt": "text", ...}`, the text a user's message, or `{"prompt":
[messages], ...}`, a conversation that ends before an assistant's reply. Its other columns are
kept as they are, for the reward functions, in `Splits.records`.

Each prompt is rendered with the checkpoint's chat template and the opening of the assistant's
turn (what a model continues to write its reply) and tokenised with no special tokens added, as
`data=chat` renders a held-out prompt (`zoo.data.chat_prompts.prompt_ids`). Files, the data
cache, held-out rows and bad-row handling are `data=chat`'s (`zoo.data.chat`,
`zoo.data.conversations`).

Rows that are no prompt are named (`file:line`, `file row N`): a missing or empty prompt, a role
not in `data.roles` or that the template refuses, a prompt whose last message is the
assistant's, a column named like a key its record sets (`prompt`, `where`), one longer than the
largest of `data.buckets`. `data.on_error=skip` leaves them out with a warning each, `raise`
stops before training, naming them all.

Every split holds, per prompt, `tokens` (int32, L: its ids, padded with 0), `length` (int32: its
number of ids) and `row` (int32: its index into `Splits.records` of the split, each record the
row's other columns with `prompt`, the prompt as the row gives it, and `where`, the row's name).
A batch is padded to the smallest of `data.buckets` that holds its longest prompt.
`Splits.prompts` holds the first `data.eval_replies` held-out prompts, whose replies each eval
writes, each with the ids that end a reply (the template's end-of-turn tokens).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from zoo.data.chat import (
    Reader,
    cache_settings,
    cached_arrays,
    held_out_split,
)
from zoo.data.chat_options import ChatOptions
from zoo.data.chat_prompts import held_out_prompts, prompt_ids
from zoo.data.chat_tokens import Encoder, LossOn
from zoo.data.conversations import (
    ASSISTANT,
    BadRow,
    Conversation,
    Row,
    RowKind,
    columns_of,
    conversation_files,
    part,
    read_rows,
)
from zoo.data.text import LENGTH, TOKENS

from zoo.plugin import Batch, ExampleSource, Splits, ZooError, register_data

FORMAT = "zoo-prompts-1"
"""Part of every cache entry's hash: a change to how entries are made changes this."""
PROMPTS = RowKind("data=prompts", "prompt", "use larger data.buckets (within the model's context)")
ROW = "row"
"""The batch column of each example's index into its split's `Splits.records`."""
PROMPT, WHERE = "prompt", "where"
"""The keys a record sets besides the row's other columns: the prompt as given, the row's
name."""


@dataclasses.dataclass(frozen=True)
class PromptColumns:
    """The column name of a row's prompt."""

    kind: ClassVar[RowKind] = PROMPTS
    prompt: str = "prompt"

    @property
    def names(self) -> tuple[str, ...]:
        return (self.prompt,)

    def described(self) -> str:
        return f"'{self.prompt}'"


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A row's prompt as messages, and its record: its other columns and the prompt as given."""

    messages: tuple[dict[str, Any], ...]
    record: dict[str, Any]


def prompt_row(record: Any, columns: PromptColumns, roles: Sequence[str]) -> Prompt:
    """The prompt of one row (a `zoo.data.conversations.Parse`); `BadRow` names what is wrong
    with it."""
    record = columns_of(record)
    given = record.get(columns.prompt)
    if given is None:
        raise BadRow(f"has no '{columns.prompt}'")
    messages = part(given, columns.prompt, "user", roles)
    if messages[-1]["role"] == ASSISTANT:
        raise BadRow(
            f"has a '{columns.prompt}' whose last message is the assistant's: a prompt ends "
            "where the reply it asks for begins"
        )
    for key in (PROMPT, WHERE):
        if key in record and key != columns.prompt:
            raise BadRow(
                f"has a column '{key}', which its record for the reward functions sets itself "
                f"(to the {'prompt' if key == PROMPT else 'row name'}): rename the column"
            )
    others = {key: value for key, value in record.items() if key != columns.prompt}
    return Prompt(messages, {**others, PROMPT: given})


def as_conversation(record: Any, columns: PromptColumns, roles: Sequence[str]) -> Conversation:
    """The prompt of one row as a conversation that is all prompt (for `held_out_prompts`)."""
    messages = prompt_row(record, columns, roles).messages
    return Conversation(messages, prompt=len(messages))


@dataclasses.dataclass(frozen=True)
class EncodedPrompts:
    """Tokenised prompts, end to end: prompt i is `ids[starts[i]:starts[i + 1]]`, its record
    `records[i]`."""

    ids: np.ndarray
    starts: np.ndarray
    wheres: list[str]
    problems: list[tuple[str, str]]
    records: list[dict[str, Any]]

    def __len__(self) -> int:
        return len(self.wheres)

    @classmethod
    def joined(cls, parts: Sequence[EncodedPrompts]) -> EncodedPrompts:
        """The prompts of `parts`, one after another."""
        sizes = np.cumsum([0] + [len(p.ids) for p in parts[:-1]])
        return cls(
            np.concatenate([p.ids for p in parts]),
            np.concatenate([[0]] + [p.starts[1:] + size for p, size in zip(parts, sizes)]),
            [w for p in parts for w in p.wheres],
            [problem for p in parts for problem in p.problems],
            [r for p in parts for r in p.records],
        )

    def lengths(self, rows: np.ndarray) -> np.ndarray:
        """The number of ids of each of the prompts `rows`."""
        return (self.starts[rows + 1] - self.starts[rows]).astype(np.int32)


def encoded_prompts(
    file: Path,
    encoder: Encoder,
    settings: bytes,
    columns: PromptColumns,
    roles: Sequence[str],
    longest: int,
) -> EncodedPrompts:
    """`file`'s prompts tokenised, from the cache, or tokenised into it first (`settings`: the
    hash of everything else the entry depends on), with their records, read from the file each
    time: the cache holds ids, and the records' values stay as the file holds them."""
    rows = read_rows(file, columns, roles, prompt_row, every_column=True)

    def make() -> dict[str, np.ndarray]:
        return _encode(rows, encoder, longest)

    entry = FORMAT.encode() + settings + str(longest).encode()
    stored = cached_arrays(file, entry, "prompts", make)
    wheres = stored["wheres"].tolist()
    records = {row.where: row.conversation.record for row in rows if row.problem is None}
    return EncodedPrompts(
        stored["ids"],
        stored["starts"],
        wheres,
        [tuple(p) for p in json.loads(str(stored["problems"]))],
        [{**records[w], WHERE: w} for w in wheres],
    )


def _encode(rows: Sequence[Row], encoder: Encoder, longest: int) -> dict[str, np.ndarray]:
    """The arrays of a cache entry: the good prompts' ids end to end, where each starts, their
    names, and the bad rows' names and problems (as JSON)."""
    ids, wheres, problems = [], [], []
    for row in rows:
        if row.problem is not None:
            problems.append((row.where, row.problem))
            continue
        try:
            _, row_ids = prompt_ids(encoder, row.conversation.messages)
        except ZooError as e:  # the template's refusal of this prompt
            problems.append((row.where, str(e)))
            continue
        if len(row_ids) > longest:
            said = f"longer than the largest bucket ({longest} of data.buckets)"
            problems.append((row.where, f"is {len(row_ids)} tokens long, {said}"))
            continue
        ids.append(row_ids)
        wheres.append(row.where)
    return {
        "ids": np.concatenate([*ids, np.empty(0, np.int32)]).astype(np.int32),
        "starts": np.cumsum([0] + [len(i) for i in ids]).astype(np.int64),
        "wheres": np.asarray(wheres, dtype=str),
        "problems": np.asarray(json.dumps(problems)),
    }


class PromptExamples(ExampleSource):
    """Some prompts of an `EncodedPrompts`, each padded to `longest` ids; example i's `row` is
    i, its index into the split's records."""

    def __init__(self, encoded: EncodedPrompts, rows: np.ndarray, longest: int):
        self.encoded, self.rows, self.longest = encoded, np.asarray(rows, np.int64), longest

    def __len__(self) -> int:
        return len(self.rows)

    def examples(self, rows: np.ndarray, epochs: np.ndarray | None, seed: int) -> Batch:
        chosen = self.rows[rows]
        lengths = self.encoded.lengths(chosen)
        tokens = np.zeros((len(rows), self.longest), np.int32)
        for i, (start, length) in enumerate(zip(self.encoded.starts[chosen], lengths)):
            tokens[i, :length] = self.encoded.ids[start : start + length]
        return {TOKENS: tokens, LENGTH: lengths, ROW: np.asarray(rows, np.int32)}

    def records(self) -> list[dict[str, Any]]:
        """The record of each example, in order: what `row` indexes."""
        return [self.encoded.records[r] for r in self.rows]


class PromptPadding:
    """Batch transform: cut the prompts' ids to the smallest of the buckets that holds the
    batch's longest prompt, so batches come in a few fixed shapes."""

    def __init__(self, buckets: Sequence[int]):
        self.buckets = sorted(buckets)

    def __call__(self, batch: Batch) -> Batch:
        longest = int(batch[LENGTH].max())
        bucket = next(b for b in self.buckets if b >= longest)
        return {TOKENS: batch[TOKENS][:, :bucket]}


@register_data("prompts")
def prompts(
    # A JSON Lines (`.jsonl`, `.json`) or Parquet file of prompts, a folder of them, or a folder
    # with `train/` and `val/` folders of them (required).
    path: str | None = None,
    prompt: str = "prompt",  # the column of prompts: text (a user's message) or messages
    *,
    options: ChatOptions,
) -> Splits:
    """Prompts rendered with a checkpoint's chat template and the opening of the assistant's
    turn, each with its row's other columns for reward functions (see the module's doc)."""
    file, encoder = options.encoder(LossOn.completion, PROMPTS)
    columns = PromptColumns(prompt)
    roles = options.roles
    longest = max(options.buckets)
    load = functools.partial(
        encoded_prompts,
        encoder=encoder,
        settings=cache_settings(file, encoder, columns, roles),
        columns=columns,
        roles=roles,
        longest=longest,
    )
    train_files, val_files = conversation_files(path, PROMPTS)
    train, train_rows, test, test_rows = held_out_split(
        Reader(path, load, PROMPTS), train_files, val_files, options
    )
    train_split = PromptExamples(train, train_rows, longest)
    eval_split = PromptExamples(test, test_rows, longest)
    return Splits(
        train=train_split,
        eval=eval_split,
        transform=PromptPadding(options.buckets),
        tokenizer=encoder.tokenizer,
        prompts=held_out_prompts(
            [test.wheres[r] for r in test_rows],
            val_files or train_files,
            encoder,
            columns,
            options,
            longest
            + options.eval_reply_tokens,  # every prompt fits the largest bucket: a full reply
            parse=as_conversation,
        ),
        records={"train": train_split.records(), "eval": eval_split.records()},
        end_of_turn=encoder.stop_ids,
    )

"""`data=preference data.path=...`: preference pairs (a prompt, a chosen and a rejected reply) for
fine-tuning a chat model on which of two replies is the better one (`finetune.method=dpo` and
the rest of the DPO family read them).

A row (JSON Lines or Parquet, as TRL and Hugging Face `datasets` hold them; the columns are
settings, other columns are ignored) is one of:

- an explicit prompt, text: `{"prompt": "...", "chosen": "...", "rejected": "..."}`: the prompt
  a user's message, each reply an assistant's message;
- an explicit prompt, conversational: `{"prompt": [messages], "chosen": [messages], "rejected":
  [messages]}`, each reply the assistant's messages;
- an implicit prompt: `{"chosen": [messages], "rejected": [messages]}`, two whole conversations
  whose shared opening messages are the prompt and whose different endings are the replies.

Each pair becomes two conversations, the prompt and the chosen reply, the prompt and the rejected
one, rendered and tokenised as `data=chat` renders a prompt and its completion
(`zoo.data.chat_tokens`), the reply's tokens carrying loss (its end-of-turn token included):
the masks `data=chat` gives the same conversation with `data.loss_on=completion`. Files, the
data cache, held-out rows and held-out prompts are `data=chat`'s (`zoo.data.chat`,
`zoo.data.conversations`, `zoo.data.chat_prompts`); a pair is one example.

Rows that are no pair to train on are named (`file:line`, `file row N`): a missing or empty
reply, the same reply twice, a role not in `data.roles` or that the template refuses, a reply
that is not the assistant's, conversations without a shared prompt. `data.on_error=skip` leaves
them out with a warning each, `raise` stops before training, naming them all.

Every split holds, per pair, `tokens` (int32, 2 x (L + 1)), `length` (int32, 2: the real
targets of each) and `loss_mask` (uint8, 2 x L: 1 where the target is a reply's token); index 0
is the chosen side, 1 the rejected. A batch is padded to the smallest of `data.buckets` that
holds its longest sequence of either side; a longer pair is cut to the largest bucket, and one
left without a reply's token on either of its sides is skipped, said in a warning.

`data.packing=true` packs the training pairs several to an example instead (the held-out ones
stay one to an example): its chosen row holds the chosen sequences of its pairs end to end, its
rejected row their rejected sequences, pair k the segment k of both, with `segment_ids` and
`positions` (2 x L each) as `data=chat` packs conversations (`zoo.data.packing`, first-fit by the
longer of a pair's sequences), and `pair_slots` (uint8, S: 1 for each segment that holds a pair,
S the most pairs any example of the split holds). The preference losses take each pair's loss
and weight an example by its pairs (`zoo.engine.posttraining.objectives`), so a step's loss is
the mean over its pairs, packed or not.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from zoo.data.chat import (
    ChatExamples,
    ChatPadding,
    Encoded,
    Reader,
    cache_settings,
    cached_arrays,
    held_out_split,
    trainable_rows,
)
from zoo.data.chat_options import ChatOptions
from zoo.data.chat_prompts import held_out_prompts
from zoo.data.chat_tokens import Encoder, LossOn, RowProblem
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
from zoo.data.packing import pack, packed_rows
from zoo.data.text import LENGTH, TOKENS

from zoo.plugin import LOSS_MASK, PAIR_SLOTS, Batch, ExampleSource, Splits, register_data

FORMAT = "zoo-preference-1"
"""Part of every cache entry's hash: a change to how entries are made changes this."""
PAIRS = RowKind(
    "data=preference",
    "preference pair",
    "use larger data.buckets (within the model's context), so that both replies start within "
    "the largest",
)
CHOSEN, REJECTED = 0, 1
"""The index of each side along a pair's axis of `tokens`, `length` and `loss_mask`."""


@dataclasses.dataclass(frozen=True)
class PreferenceColumns:
    """The column names of a pair's prompt and replies."""

    kind: ClassVar[RowKind] = PAIRS
    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"

    @property
    def names(self) -> tuple[str, ...]:
        return self.prompt, self.chosen, self.rejected

    def described(self) -> str:
        return f"'{self.chosen}' and '{self.rejected}', with or without '{self.prompt}'"


@dataclasses.dataclass(frozen=True)
class Pair:
    """A preference pair as two conversations, the prompt and each reply (each conversation's
    `prompt`: how many of its messages are the prompt)."""

    chosen: Conversation
    rejected: Conversation


def preference_pair(record: Any, columns: PreferenceColumns, roles: Sequence[str]) -> Pair:
    """The pair of one row (a `zoo.data.conversations.Parse`); `BadRow` names what is wrong with
    it."""
    record = columns_of(record)
    sides = (columns.chosen, columns.rejected)
    for column in sides:
        if record.get(column) is None:
            raise BadRow(f"has no '{column}' reply")
        if not record[column]:
            raise BadRow(f"has an empty '{column}' reply")
    if record.get(columns.prompt) is None:
        asked, replies = _implicit(record, columns, roles)
    else:
        asked = part(record[columns.prompt], columns.prompt, "user", roles)
        replies = tuple(part(record[c], c, ASSISTANT, roles) for c in sides)
        for reply, column in zip(replies, sides):
            if (role := _not_assistant(reply)) is not None:
                raise BadRow(
                    f"has a '{column}' reply with a {role!r} message: a reply is the "
                    "assistant's messages"
                )
    if replies[CHOSEN] == replies[REJECTED]:
        raise BadRow(
            f"has the same '{columns.chosen}' and '{columns.rejected}' reply: a pair prefers one "
            "of two different replies"
        )
    chosen, rejected = (Conversation((*asked, *reply), prompt=len(asked)) for reply in replies)
    return Pair(chosen, rejected)


def _implicit(
    record: Any, columns: PreferenceColumns, roles: Sequence[str]
) -> tuple[tuple[dict, ...], tuple[tuple[dict, ...], ...]]:
    """(the prompt, the replies) of two whole conversations: the messages they open with alike,
    and what follows in each."""
    chosen, rejected = (
        part(record[c], c, ASSISTANT, roles) for c in (columns.chosen, columns.rejected)
    )
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise BadRow(
            f"has no '{columns.prompt}' and no prompt that '{columns.chosen}' and "
            f"'{columns.rejected}' share: without a prompt column, they are whole conversations "
            "that open with the same messages"
        )
    for reply, column in ((chosen, columns.chosen), (rejected, columns.rejected)):
        if len(reply) == shared and chosen != rejected:
            raise BadRow(f"has no '{column}' reply after the prompt it shares")
        if (role := _not_assistant(reply[shared:])) is not None:
            raise BadRow(
                f"has '{columns.chosen}' and '{columns.rejected}' that differ at message "
                f"{shared}, before a {role!r} message: the prompt they share must end where the "
                "assistant's last turn begins"
            )
    return chosen[:shared], (chosen[shared:], rejected[shared:])


def _not_assistant(reply: Sequence[dict]) -> str | None:
    """The role of a reply's first message that is not the assistant's, if any."""
    return next((m["role"] for m in reply if m["role"] != ASSISTANT), None)


@dataclasses.dataclass(frozen=True)
class EncodedPairs:
    """Tokenised pairs: pair i is conversation i of `chosen` (the prompt and the chosen reply)
    and of `rejected`; the bad rows are `chosen`'s problems."""

    chosen: Encoded
    rejected: Encoded

    @property
    def wheres(self) -> list[str]:
        return self.chosen.wheres

    @property
    def problems(self) -> list[tuple[str, str]]:
        return self.chosen.problems

    def __len__(self) -> int:
        return len(self.chosen)

    @classmethod
    def joined(cls, parts: Sequence[EncodedPairs]) -> EncodedPairs:
        """The pairs of `parts`, one after another."""
        return cls(
            Encoded.joined([p.chosen for p in parts]), Encoded.joined([p.rejected for p in parts])
        )

    def trains(self, row: int, longest: int) -> bool:
        """Whether both of pair `row`'s replies have a token within the first `longest`
        targets: a reply cut off whole leaves nothing to prefer."""
        return self.chosen.trains(row, longest) and self.rejected.trains(row, longest)


def encoded_pairs(
    file: Path,
    encoder: Encoder,
    settings: bytes,
    columns: PreferenceColumns,
    roles: Sequence[str],
) -> EncodedPairs:
    """`file`'s pairs tokenised, from the cache, or tokenised into it first; `settings`: the
    hash of everything else the entry depends on (`zoo.data.chat.cache_settings`)."""

    def make() -> dict[str, np.ndarray]:
        pairs = _encode_pairs(read_rows(file, columns, roles, preference_pair), encoder)
        return {**pairs.chosen.stored("chosen_"), **pairs.rejected.stored("rejected_")}

    stored = cached_arrays(file, FORMAT.encode() + settings, "preference", make)
    return EncodedPairs(Encoded.loaded(stored, "chosen_"), Encoded.loaded(stored, "rejected_"))


def _encode_pairs(rows: Sequence[Row], encoder: Encoder) -> EncodedPairs:
    kept, wheres, problems = [], [], []
    for row in rows:
        if row.problem is not None:
            problems.append((row.where, row.problem))
            continue
        pair = row.conversation
        try:
            kept.append([encoder.encode(pair.chosen), encoder.encode(pair.rejected)])
        except RowProblem as e:
            problems.append((row.where, str(e)))
            continue
        wheres.append(row.where)
    chosen, rejected = (
        Encoded.made([k[side][0] for k in kept], [k[side][1] for k in kept], wheres, bad)
        for side, bad in ((CHOSEN, problems), (REJECTED, []))
    )
    return EncodedPairs(chosen, rejected)


class PairExamples(ExampleSource):
    """Some pairs of an `EncodedPairs`, each side cut to `longest` targets and padded
    (`ChatExamples` of each side, stacked along the pair's axis)."""

    def __init__(self, pairs: EncodedPairs, rows: np.ndarray, longest: int):
        self.pairs = pairs
        self.sides = [ChatExamples(s, rows, longest) for s in (pairs.chosen, pairs.rejected)]
        self.rows = self.sides[CHOSEN].rows

    def __len__(self) -> int:
        return len(self.rows)

    def examples(self, rows: np.ndarray, epochs: np.ndarray | None, seed: int) -> Batch:
        made = [side.examples(rows, epochs, seed) for side in self.sides]
        return {c: np.stack([m[c] for m in made], axis=1) for c in (TOKENS, LENGTH, LOSS_MASK)}


class PackedPairExamples(PairExamples):
    """The pairs packed several to an example (`data.packing`): the chosen sequences of its
    pairs end to end in its first row, their rejected ones in its second, pair k the segment k
    of both, placed first-fit by the longer of its sequences (`zoo.data.packing`); the
    `PAIR_SLOTS` column marks the slots that hold a pair, out of the most any example holds."""

    def __init__(self, pairs: EncodedPairs, rows: np.ndarray, longest: int):
        super().__init__(pairs, rows, longest)
        sizes = np.maximum(*(np.diff(s.encoded.starts)[self.rows] for s in self.sides))
        self.packs = packed_rows(np.minimum(sizes, longest + 1), longest + 1)
        self.slots = max((len(p) for p in self.packs), default=1)

    def __len__(self) -> int:
        return len(self.packs)

    def examples(self, rows: np.ndarray, epochs: np.ndarray | None, seed: int) -> Batch:
        made = [
            pack([[side.piece(self.rows[i]) for i in self.packs[r]] for r in rows], side.longest)
            for side in self.sides
        ]
        slots = np.zeros((len(rows), self.slots), np.uint8)
        for i, row in enumerate(rows):
            slots[i, : len(self.packs[row])] = 1
        return {**{c: np.stack([m[c] for m in made], axis=1) for c in made[0]}, PAIR_SLOTS: slots}


def _chosen(record: Any, columns: PreferenceColumns, roles: Sequence[str]) -> Conversation:
    """A row's prompt and chosen reply: what a held-out prompt is asked with and answered."""
    return preference_pair(record, columns, roles).chosen


@register_data("preference")
def preference(
    # A JSON Lines (`.jsonl`, `.json`) or Parquet file of preference pairs, a folder of them, or
    # a folder with `train/` and `val/` folders of them (required).
    path: str | None = None,
    # The column of prompts: text (a user's message) or messages; a row without one: the
    # messages its chosen and rejected conversations open with alike.
    prompt: str = "prompt",
    chosen: str = "chosen",  # the column of preferred replies: text or messages
    rejected: str = "rejected",  # the column of dispreferred replies: text or messages
    # Training examples of several pairs (the chosen sequences end to end in one row, the
    # rejected ones in another, the largest bucket long), attention and positions kept within
    # each sequence (a decoder only): less padding, more pairs per step.
    packing: bool = False,
    *,
    options: ChatOptions,
) -> Splits:
    """Preference pairs rendered with a checkpoint's chat template, each a chosen and a rejected
    sequence with a loss mask over its reply (see the module's doc); one pair to an example, or
    several packed."""
    file, encoder = options.encoder(LossOn.completion, PAIRS)
    columns = PreferenceColumns(prompt, chosen, rejected)
    roles = options.roles
    settings = cache_settings(file, encoder, columns, roles)
    load = functools.partial(
        encoded_pairs, encoder=encoder, settings=settings, columns=columns, roles=roles
    )
    train_files, val_files = conversation_files(path, PAIRS)
    train, train_rows, test, test_rows = held_out_split(
        Reader(path, load, PAIRS), train_files, val_files, options
    )
    longest = max(options.buckets)
    held = trainable_rows(test, test_rows, longest, "held-out", PAIRS)
    trained = trainable_rows(train, train_rows, longest, "training", PAIRS)
    return Splits(
        train=(PackedPairExamples if packing else PairExamples)(train, trained, longest),
        eval=PairExamples(test, held, longest),
        transform=ChatPadding(list(options.buckets)),
        tokenizer=encoder.tokenizer,
        prompts=held_out_prompts(
            [test.wheres[r] for r in held],
            val_files or train_files,
            encoder,
            columns,
            options,
            longest,
            parse=_chosen,
        ),
    )

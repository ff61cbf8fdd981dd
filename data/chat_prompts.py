"""The held-out prompts whose replies a chat fine-tune writes to TensorBoard at each eval
(`data.eval_replies`): the first held-out conversations, each up to its last reply and rendered
with the opening of the assistant's turn by the checkpoint's template, as `zoo.generate(model,
messages=...)` renders a chat, with the reply the data holds beside the model's.

The token cache holds ids, not messages: the prompts are read again from the conversations'
files, only when the first eval asks for them, and only from the files that hold them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from zoo.data.chat_options import ChatOptions
from zoo.data.chat_tokens import Encoder
from zoo.data.conversations import ASSISTANT, ColumnNames, Conversation, Parse, read_rows

from zoo.plugin import ReplyPrompt


@functools.cache
def _nothing() -> list[ReplyPrompt]:
    return []


def held_out_prompts(
    wheres: Sequence[str],
    files: Sequence[Path],
    encoder: Encoder,
    columns: ColumnNames,
    options: ChatOptions,
    longest: int,
    parse: Parse | None = None,
) -> Callable[[], list[ReplyPrompt]]:
    """The prompts of the first `data.eval_replies` of the held-out conversations named `wheres`
    (in order) whose prompt leaves room for a reply within `longest` tokens, made on first call;
    each reply takes at most `data.eval_reply_tokens` new tokens, and no more than that room.
    `parse`: the conversation of a row (`read_rows`' own unless given), whose reply is the
    reference."""
    count, reply_tokens = options.eval_replies, options.eval_reply_tokens
    if count == 0:
        return _nothing

    @functools.cache
    def prompts() -> list[ReplyPrompt]:
        conversations = _conversations(wheres, files, columns, options.roles, parse)
        made = []
        for where in wheres:
            prompt = _prompt(conversations[where], encoder, reply_tokens, longest)
            if prompt is not None:
                made.append(prompt)
            if len(made) == count:
                break
        return made

    return prompts


def _conversations(
    wheres: Sequence[str],
    files: Sequence[Path],
    columns: ColumnNames,
    roles: Sequence[str],
    parse: Parse | None,
) -> dict[str, Conversation]:
    """The conversations named `wheres`, read from the files that hold them."""
    wanted = set(wheres)
    found = {}
    for file in files:
        if any(w.startswith((f"{file}:", f"{file} row ")) for w in wanted):
            rows = read_rows(file, columns, roles, parse)
            found.update({row.where: row.conversation for row in rows})
    return {w: found[w] for w in wheres}


def _prompt(
    conversation: Conversation, encoder: Encoder, reply_tokens: int, longest: int
) -> ReplyPrompt | None:
    """The prompt before a conversation's last reply (a prompt and completion's prompt), or
    None when it leaves no room for a reply within `longest` tokens."""
    messages = list(conversation.messages)
    if conversation.prompt is not None:
        cut = conversation.prompt
    else:
        cut = max(i for i, m in enumerate(messages) if m["role"] == ASSISTANT)
    text, ids = prompt_ids(encoder, messages[:cut])
    room = min(reply_tokens, longest - len(ids))
    if room < 1:
        return None
    reference = "".join(_text(m.get("content")) for m in messages[cut:])
    return ReplyPrompt(ids, text, reference, encoder.stop_ids, room)


def prompt_ids(encoder: Encoder, messages: Sequence[dict[str, Any]]) -> tuple[str, np.ndarray]:
    """What a model reads before its reply to `messages`: the template's text with the opening
    of the assistant's turn, and its ids (int32; no special tokens added: the template writes
    them). A template's refusal is its `ZooError`."""
    text = encoder.render(list(messages), add_generation_prompt=True)
    ids = np.asarray(encoder.tokenizer.encode(text, add_special_tokens=False).ids, np.int32)
    return text, ids


def _text(content: Any) -> str:
    """A message's content as text (structured content as JSON)."""
    if isinstance(content, str):
        return content
    return "" if content is None else json.dumps(content, ensure_ascii=False)

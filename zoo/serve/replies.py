"""A reply's JSON in the layout of its route: a completion (`text_completion`) or a chat
completion (`chat.completion`), whole, or as the chunks of a stream
(`chat.completion.chunk`), each a server-sent event (`sse`)."""

from __future__ import annotations

import json
import time
import uuid

from zoo.serve.choices import Choice, completion_logprobs
from zoo.serve.requests import Parsed


def sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


class Reply:
    """The reply to one request, its `choices` filled as the engine writes them."""

    def __init__(self, name: str, parsed: Parsed, chat: bool, choices: list[Choice], prompt: int):
        self.name, self.parsed, self.chat, self.choices = name, parsed, chat, choices
        self.prompt_tokens = prompt
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def head(self, chunk: bool) -> dict:
        kind = "text_completion"
        if self.chat:
            kind = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.name}

    def usage(self) -> dict:
        written = sum(c.tokens for c in self.choices)
        total = self.prompt_tokens + written
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": written,
                "total_tokens": total}  # fmt: skip

    def whole(self) -> dict:
        choices = []
        for index, c in enumerate(self.choices):
            logprobs = None if c.top_logprobs is None else self._logprobs(c.logprobs, c.offsets)
            said = {"text": c.text}
            if self.chat:
                said = {"message": {"role": "assistant", "content": c.text}}
            choices.append({"index": index, **said, "logprobs": logprobs,
                            "finish_reason": c.finish})  # fmt: skip
        return {**self.head(chunk=False), "choices": choices, "usage": self.usage()}

    def chunk(self, index: int, piece: str, entry: dict | None, finish: str | None) -> dict:
        """A stream's chunk of choice `index`: a text piece, its token's log-probabilities,
        and its finish_reason at the end."""
        said = {"delta": {"content": piece} if piece else {}} if self.chat else {"text": piece}
        offsets = self.choices[index].offsets[-1:]
        logprobs = None if entry is None else self._logprobs([entry], offsets)
        return self._chunk(index, said, logprobs, finish)

    def opening(self, index: int) -> dict:
        """A chat stream's first chunk of choice `index`: the assistant's role."""
        return self._chunk(index, {"delta": {"role": "assistant", "content": ""}}, None, None)

    def _chunk(self, index: int, said: dict, logprobs, finish) -> dict:
        choice = {"index": index, **said, "logprobs": logprobs, "finish_reason": finish}
        return {**self.head(chunk=True), "choices": [choice]}

    def _logprobs(self, entries: list[dict], offsets: list[int]) -> dict:
        return {"content": entries} if self.chat else completion_logprobs(entries, offsets)

"""A request's choices as the engine writes them: each choice a row of the running batch
(`zoo.models.serving_engine`), its tokens turned into text pieces (`Pieces`: held back while
they could begin a stop string), log-probabilities in the API's two layouts, and the choices'
events gathered from the engine's thread onto the server's event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from zoo.models.serving_engine import Finished, Ticket, Token
from zoo.models.text_completion import Codec, Pieces

FINISH = {"eos": "stop", "stop": "stop", "length": "length"}
"""The API's finish_reason of each way a row ends."""


@dataclasses.dataclass
class Choice:
    """One choice's text so far, its tokens' log-probabilities (where asked) and its end.
    `at`: where its next token begins in its prompt and text together (the legacy layout's
    `text_offset`, counted from the start of the prompt), each token's in `offsets`."""

    pieces: Pieces
    top_logprobs: int | None
    at: int = 0
    tokens: int = 0
    logprobs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    offsets: list[int] = dataclasses.field(default_factory=list)
    finish: str | None = None

    def add(self, event: Token | Finished, codec: Codec) -> tuple[str, dict | None]:
        """The text `event` releases and its token's log-probabilities (None unless asked)."""
        if isinstance(event, Finished):
            self.finish = FINISH.get(event.reason, event.reason)
            return self.pieces.add([], ended=True), None
        self.tokens += 1
        entry = None
        if self.top_logprobs is not None:
            entry = token_logprobs(event, self.top_logprobs, codec)
            self.logprobs.append(entry)
            self.offsets.append(self.at)
            self.at += len(entry["token"])
        return self.pieces.add([event.token], ended=False), entry

    @property
    def text(self) -> str:
        return self.pieces.shown


def token_logprobs(event: Token, top: int, codec: Codec) -> dict[str, Any]:
    """A token's entry in a chat reply's `logprobs.content`."""

    def said(token: int, logprob: float) -> dict[str, Any]:
        text = codec.decode([token])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    alternatives = [said(t, lp) for t, lp in event.top[:top]]
    return {**said(event.token, event.logprob), "top_logprobs": alternatives}


def completion_logprobs(entries: list[dict[str, Any]], offsets: list[int]) -> dict[str, Any]:
    """The legacy completions layout of the same entries: each token's alternatives with the
    token itself (up to `logprobs` + 1 of them, as OpenAI's), and its `offsets`. The
    alternatives are keyed by their text, so tokens that decode alike (pieces of one
    character's bytes, each shown as U+FFFD) share a key: the token drawn keeps its own
    log-probability there, as in `token_logprobs`, and any other text its likeliest token's."""
    tops = []
    for e in entries:
        top: dict[str, float] = {}
        for a in e["top_logprobs"]:
            top.setdefault(a["token"], a["logprob"])
        top[e["token"]] = e["logprob"]
        tops.append(top)
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": tops,
        "text_offset": list(offsets),
    }


class Events:
    """The events of a request's tickets, delivered from the engine's thread into an asyncio
    queue of the server's loop."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tickets: list[Ticket] = []

    def deliver(self, index: int, event: Token | Finished) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))

    async def each(self, choices: list[Choice]) -> AsyncIterator[tuple[int, Token | Finished]]:
        """(choice, event) until every choice has finished."""
        left = len(choices)
        while left:
            index, event = await self.queue.get()
            left -= isinstance(event, Finished)
            yield index, event

    def cancel(self) -> None:
        """Free the rows of a request whose client went away."""
        for ticket in self.tickets:
            ticket.cancel()

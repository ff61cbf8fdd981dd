"""Text from a language model (`gpt`, `decoder`): prompts encoded, new tokens decoded and
checked against stop strings, as whole texts or as a stream of pieces. The loop beneath
(batches, cache, sampling): `zoo.models.sampling_loop`; what the models write at each eval:
`zoo.models.eval_samples`.

A model speaks bytes (no tokenizer: its ids are a text's UTF-8 bytes, and what it writes is
decoded with each invalid sequence replaced by U+FFFD, since a byte model may write any bytes)
or a tokenizer's ids (`tokenizers.Tokenizer`, the one it was trained with).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from zoo.models.sampling_loop import (
    Completion,
    Sampling,
    Session,
    require_language_model,
    session_for,
)

from zoo.plugin import ZooError


@dataclasses.dataclass(frozen=True)
class Codec:
    """Text to a model's ids and back: bytes, or `tokenizer`'s ids. A text gets the special
    tokens its tokenizer adds (`tokenizer.json`'s post-processor: Llama 3's and Gemma 3's
    prepend BOS), as transformers' tokenizer gives them, unless it is `rendered` by a chat
    template, which writes its own."""

    tokenizer: Any = None
    rendered: bool = False

    def encode(self, text: str | bytes | np.ndarray) -> np.ndarray:
        if isinstance(text, np.ndarray):  # token ids already
            return text.astype(np.int32)
        if self.tokenizer is None:
            data = text.encode() if isinstance(text, str) else bytes(text)
            return np.frombuffer(data or b"\n", np.uint8).astype(np.int32)
        text = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return np.asarray(
            self.tokenizer.encode(text or "\n", add_special_tokens=not self.rendered).ids,
            np.int32,
        )

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            beyond = [int(i) for i in ids if not 0 <= i < 256]
            if beyond:
                raise ZooError(
                    f"The model wrote id {beyond[0]}, which is no byte: a model whose ids are "
                    "not bytes writes text through its tokenizer (tokenizer=, or a checkpoint "
                    "with its tokenizer.json)."
                )
            return bytes(np.asarray(ids, np.uint8)).decode("utf-8", errors="replace")
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


@dataclasses.dataclass(frozen=True)
class Request:
    """What to write after each prompt: `max_new_tokens` at most, chosen as `sampling` says
    (`seed`: an int or a JAX key; row r draws from `fold_in(key, r)`), each row ending at one of
    the `eos` ids or at the first of the `stop` strings (cut from its text)."""

    max_new_tokens: int = 100
    sampling: Sampling = dataclasses.field(default_factory=Sampling)
    seed: int | jax.Array = 0
    eos: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: bool = False


def complete(
    model: Any, prompts: Sequence[str | bytes], request: Request, codec: Codec
) -> list[Completion]:
    """Every prompt's `Completion`, `text` included, decoded in one batch."""
    session, ids = _prepared(model, prompts, request, codec)
    done = session.generate(
        ids,
        request.max_new_tokens,
        request.sampling,
        request.seed,
        request.eos,
        _stop_check(request.stop, codec),
        request.logprobs,
    )
    for row in done:
        row.text = _cut(codec.decode(row.tokens), request.stop)
    return done


def stream(model: Any, prompt: str | bytes, request: Request, codec: Codec) -> Iterator[str]:
    """The text written after `prompt`, piece by piece as its tokens come (a piece held back
    while it ends in an incomplete character or could be the start of a stop string)."""
    session, ids = _prepared(model, [prompt], request, codec)
    check = _stop_check(request.stop, codec)
    steps = session.stream(
        ids, request.max_new_tokens, request.sampling, request.seed, request.eos, check
    )
    return _pieces(steps, request, codec, check)


def _pieces(steps, request: Request, codec: Codec, check) -> Iterator[str]:
    pieces = Pieces(codec, request.stop)
    for step in steps:
        new = [t.token for t in step if t.token not in request.eos]
        ended = all(t.token in request.eos for t in step) or (
            check and check(0, pieces.written + new)
        )
        if piece := pieces.add(new, ended):
            yield piece
    if piece := pieces.add([], ended=True):
        yield piece


class Pieces:
    """A row's text as its tokens come, released in pieces: a piece is held back while it ends
    in an incomplete character or could be the start of a `stop` string, and the text ends
    before the first stop string."""

    def __init__(self, codec: Codec, stop: tuple[str, ...]):
        self.codec, self.stop = codec, stop
        self.written: list[int] = []
        self.shown = ""

    def add(self, tokens: Sequence[int], ended: bool) -> str:
        """The text that `tokens` (the row's next ones) release; all that is left where the
        row `ended`."""
        self.written.extend(tokens)
        text = _cut(self.codec.decode(self.written), self.stop)
        ready = text if ended else _settled(text, self.stop)
        if len(ready) <= len(self.shown):
            return ""
        piece, self.shown = ready[len(self.shown) :], ready
        return piece


def stop_check(stop: tuple[str, ...], codec: Codec) -> Callable[[list[int]], bool] | None:
    """Whether a row's tokens so far hold one of the `stop` strings (None: no stops)."""
    if not stop:
        return None
    return lambda tokens: any(s in codec.decode(tokens) for s in stop)


def _prepared(model, prompts, request: Request, codec: Codec) -> tuple[Session, list[np.ndarray]]:
    require_language_model(model)
    context, new = model.context_length, request.max_new_tokens
    if not 1 <= new < context:
        raise ZooError(
            f"max_new_tokens={new} must lie between 1 and context_length - 1 = {context - 1}: "
            f"prompt and new tokens share the model's {context} positions."
        )
    ids = [_kept(codec.encode(p), context - new) for p in prompts]
    if max(int(i.max()) for i in ids) >= model.vocab_size:
        raise ZooError(
            f"The tokenizer gives id {max(int(i.max()) for i in ids)} for a prompt, beyond the "
            f"model's vocabulary of {model.vocab_size}: use the tokenizer the model was trained "
            "with."
        )
    return session_for(model, ids, new), ids


def _kept(ids: np.ndarray, room: int) -> np.ndarray:
    """A prompt's last `room` tokens: the prompt and the new tokens share the context."""
    return ids[max(0, len(ids) - room) :]


def _stop_check(stop: tuple[str, ...], codec: Codec):
    check = stop_check(stop, codec)
    return None if check is None else lambda row, tokens: check(tokens)


def _cut(text: str, stop: tuple[str, ...]) -> str:
    """`text` up to the first stop string in it."""
    ends = [text.find(s) for s in stop if s in text]
    return text[: min(ends)] if ends else text


def _settled(text: str, stop: tuple[str, ...]) -> str:
    """The part of `text` that later tokens cannot change: without a trailing incomplete
    character (U+FFFD), nor an ending that a stop string starts with."""
    text = text.rstrip("\ufffd")
    held = max((n for s in stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
    return text[: len(text) - held]


def generate(
    model: Any, prompt: str | bytes, *args: Any, tokenizer: Any = None, **kwargs: Any
) -> str:
    """The text that `model` writes after `prompt` (`max_new_tokens=100, temperature=1.0,
    top_k=0, seed=0`, as `generate_tokens` takes them), through `tokenizer` or as bytes."""
    names = ("max_new_tokens", "temperature", "top_k", "seed")
    given = {**dict(zip(names, args)), **kwargs}
    sampling = Sampling(given.get("temperature", 1.0), given.get("top_k", 0))
    request = Request(given.get("max_new_tokens", 100), sampling, given.get("seed", 0))
    (done,) = complete(model, [prompt], request, Codec(tokenizer))
    return done.text


def generate_bytes(model: Any, prompt: str | bytes, *args: Any, **kwargs: Any) -> bytes:
    """The bytes that a byte-level `model` writes after `prompt` (see `generate_tokens`)."""
    tokens = Codec().encode(prompt)
    return generate_tokens(model, tokens, *args, **kwargs).astype(np.uint8).tobytes()


def generate_tokens(
    model: Any,
    prompt: np.ndarray,
    max_new_tokens: int = 100,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int | jax.Array = 0,
) -> np.ndarray:
    """The `max_new_tokens` token ids (int32) that `model` writes after the ids `prompt`.
    `temperature` 0 picks the likeliest token every time; `top_k` > 0 samples among the k
    likeliest only. `seed`: an int or a JAX key.

    The prompt keeps its last `context_length - max_new_tokens` tokens. Call it where the
    model's mesh is active (`with result.activate():`); the batch of one is not split over the
    mesh."""
    require_language_model(model)
    context = model.context_length
    if not 1 <= max_new_tokens < context:
        raise ZooError(
            f"max_new_tokens={max_new_tokens} must lie between 1 and context_length - 1 = "
            f"{context - 1}: prompt and new tokens share the model's {context} positions."
        )
    kept = [_kept(np.asarray(prompt, np.int32), context - max_new_tokens)]
    session = session_for(model, kept, max_new_tokens)
    sampling = Sampling(temperature=temperature, top_k=top_k)
    (done,) = session.generate(kept, max_new_tokens, sampling, seed)
    return np.asarray(done.tokens, np.int32)

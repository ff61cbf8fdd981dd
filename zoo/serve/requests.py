"""The bodies of OpenAI's `/v1/completions` and `/v1/chat/completions` requests, read and
checked: each bad value refused by name (`BadRequest`, a 400 in the API's error shape) with what
would be valid, never ignored; fields of the API that zoo does not implement refused too.

Defaults are OpenAI's but for `seed`: 0, as `zoo.generate`'s, so that a request without one is
reproducible and writes what `zoo.generate` writes with the same settings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

SAMPLING = ("temperature", "top_p", "top_k", "min_p")
COMMON = {"model", "max_tokens", "stream", "stream_options", "stop", "n", "seed", "user", *SAMPLING}
COMPLETIONS = COMMON | {"prompt", "logprobs"}
CHAT = COMMON | {
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "chat_template_kwargs",
}
MOST_CHOICES = 16
"""The most choices (`n`) one request may ask for."""


class BadRequest(Exception):
    """A request zoo cannot run: `message` says why, `param` names the field (or None)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


@dataclasses.dataclass(frozen=True)
class Parsed:
    """What a request asks for. `prompts`: texts (a chat's one rendered by the server);
    `max_tokens`: None for all the room a prompt leaves; `top_logprobs`: alternatives per
    token (None: no log-probabilities)."""

    model: str
    prompts: tuple[str, ...]
    max_tokens: int | None
    sampling: dict[str, float]
    n: int
    seed: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    top_logprobs: int | None
    messages: tuple[Mapping[str, Any], ...] = ()
    template_kwargs: Mapping[str, Any] | None = None


def completion_request(body: Any) -> Parsed:
    """A `/v1/completions` body: `prompt` a text or a list of texts; `logprobs` the number of
    alternatives (0 to 5) each token lists; `max_tokens` 16 unless given, as OpenAI's."""
    body = _object(body, COMPLETIONS)
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not (isinstance(prompts, list) and prompts and all(isinstance(p, str) for p in prompts)):
        raise BadRequest(f"prompt={prompt!r} must be a text or a list of texts.", "prompt")
    logprobs = _integer(body, "logprobs", None, 0, 5)
    max_tokens = _integer(body, "max_tokens", 16, 1, None)
    return _parsed(body, tuple(prompts), max_tokens, logprobs)


def chat_request(body: Any) -> Parsed:
    """A `/v1/chat/completions` body: `messages`, each a role and its content; `logprobs`
    true to list each token's log-probability with `top_logprobs` (0 to 20) alternatives;
    `max_tokens` (or `max_completion_tokens`) all the room the prompt leaves unless given;
    `chat_template_kwargs`: variables of the checkpoint's chat template."""
    body = _object(body, CHAT)
    messages = body.get("messages")
    if not (isinstance(messages, list) and messages and all(_message(m) for m in messages)):
        raise BadRequest(
            "messages must be a non-empty list of objects, each with a 'role' (a text) and a "
            f"'content' (a text); got {messages!r}.",
            "messages",
        )
    wanted = _boolean(body, "logprobs", False)
    top = _integer(body, "top_logprobs", None, 0, 20)
    if top is not None and not wanted:
        raise BadRequest("top_logprobs needs logprobs=true.", "top_logprobs")
    field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = _integer(body, field, None, 1, None)
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest(
            f"chat_template_kwargs={kwargs!r} must be an object of template variables.",
            "chat_template_kwargs",
        )
    parsed = _parsed(body, ("",), max_tokens, (top or 0) if wanted else None)
    return dataclasses.replace(parsed, messages=tuple(messages), template_kwargs=kwargs)


def _parsed(body: dict, prompts: tuple[str, ...], max_tokens, top_logprobs) -> Parsed:
    model = body.get("model")
    if not isinstance(model, str):
        raise BadRequest(f"model={model!r} must be the name of a model (GET /v1/models).", "model")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise BadRequest(
            f"stream_options={options!r}: the one option is include_usage.", "stream_options"
        )
    return Parsed(
        model=model,
        prompts=prompts,
        max_tokens=max_tokens,
        sampling={
            "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
            "top_p": _number(body, "top_p", 1.0, 0.0, 1.0, open_below=True),
            "top_k": _integer(body, "top_k", 0, 0, None),
            "min_p": _number(body, "min_p", 0.0, 0.0, 1.0, open_above=True),
        },
        n=_integer(body, "n", 1, 1, MOST_CHOICES),
        seed=_integer(body, "seed", 0, 0, 2**31 - 1),
        stop=_stops(body.get("stop")),
        stream=_boolean(body, "stream", False),
        include_usage=_boolean(options, "include_usage", False),
        top_logprobs=top_logprobs,
    )


def _object(body: Any, known: set[str]) -> dict:
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    unknown = sorted(set(body) - known)
    if unknown:
        raise BadRequest(
            f"zoo.serve does not take {', '.join(unknown)}: it takes {', '.join(sorted(known))}.",
            unknown[0],
        )
    return {name: value for name, value in body.items() if value is not None}


def _message(message: Any) -> bool:
    return (
        isinstance(message, dict)
        and isinstance(message.get("role"), str)
        and isinstance(message.get("content"), str)
    )


def _stops(stop: Any) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else stop or []
    if not (isinstance(stops, list) and len(stops) <= 4 and all(_text(s) for s in stops)):
        raise BadRequest(
            f"stop={stop!r} must be a non-empty text or a list of at most 4 of them.", "stop"
        )
    return tuple(stops)


def _text(value: Any) -> bool:
    return isinstance(value, str) and value != ""


def _boolean(body: Mapping, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise BadRequest(f"{name}={value!r} must be true or false.", name)
    return value


def _integer(body: Mapping, name: str, default, low: int, high: int | None):
    value = body.get(name, default)
    if value is default:
        return value
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        above = "" if high is None else f" and at most {high}"
        raise BadRequest(f"{name}={value!r} must be an integer of at least {low}{above}.", name)
    return value


def _number(body, name, default, low, high, open_below=False, open_above=False) -> float:
    value = body.get(name, default)
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if (
        not number
        or value < low
        or value > high
        or (open_below and value == low)
        or (open_above and value == high)
    ):
        left, right = "(" if open_below else "[", ")" if open_above else "]"
        raise BadRequest(f"{name}={value!r} must be a number in {left}{low}, {high}{right}.", name)
    return float(value)

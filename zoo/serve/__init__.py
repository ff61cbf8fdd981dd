"""`python -m zoo.serve MODEL`: a model answering OpenAI's API over HTTP (`/v1/models`,
`/v1/completions`, `/v1/chat/completions`, streamed as server-sent events), every client's
request decoded in one running batch (continuous batching: `zoo.models.serving_engine`).

`create_app(model, ...)` gives the ASGI application, to run under uvicorn (`__main__`) or any
ASGI server; it needs the `serve` extra (`pip install 'zoo[serve]'`: FastAPI and uvicorn).
Layout: `requests` reads and checks a request's body, `served` loads the model and turns a
request into the engine's rows, `choices` turns rows' tokens into text and log-probabilities,
`app` the routes and errors, `replies` the JSON of replies.
"""

from __future__ import annotations

from typing import Any

from zoo.engine.errors import ZooError

try:
    from fastapi import FastAPI
except ImportError:  # pragma: no cover - the message is the point
    raise ZooError("zoo.serve needs FastAPI and uvicorn: pip install 'zoo[serve]'.") from None

from zoo.serve.app import create_app as _app
from zoo.serve.served import Served

__all__ = ["create_app"]


def create_app(
    model: Any,
    *,
    name: str | None = None,
    rows: int = 8,
    max_length: int = 512,
    queue_size: int = 64,
    api_key: str | None = None,
) -> FastAPI:
    """The application that serves `model` (a run's workdir, a pretrained directory, a hub
    name `hf://ORG/NAME`, or a loaded run) under `name` (default: `model` as given): its
    engine holds `rows` requests at once, each of at most `max_length` tokens, prompt and reply
    together (a key/value cache of `rows` x `max_length` slots, allocated and compiled here),
    and queues `queue_size` more before answering 429. With `api_key`, every request must send
    `Authorization: Bearer API_KEY` (else 401)."""
    name = name or (model if isinstance(model, str) else "model")
    served = Served.start(model, name, rows, max_length, queue_size)
    return _app(served, api_key)

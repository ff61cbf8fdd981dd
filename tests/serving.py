"""A `zoo.serve` application running in a thread of the test process, on a free port of
127.0.0.1, and the `openai` client that calls it as users do."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import openai
import uvicorn


@contextlib.contextmanager
def running(app, api_key: str = "unused") -> Iterator[openai.OpenAI]:
    """A client of `app` served until the block ends (no retries: a 429 is seen as it is)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    started = threading.Event()
    while not started.wait(0.05):
        if server.started:
            started.set()
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key, max_retries=0)
    finally:
        server.should_exit = True
        thread.join()

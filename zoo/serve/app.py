"""The HTTP face of a served model: OpenAI's `/v1/models`, `/v1/completions` and
`/v1/chat/completions`, whole or streamed as server-sent events, errors in the API's JSON shape
(`{"error": {"message", "type", "param", "code"}}`) with its statuses: 400 a bad request, 401 a
missing or wrong API key, 404 an unknown model or route, 429 a full queue, 500 and then 503
once the engine has stopped on an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from zoo.models.serving_engine import EngineStopped, QueueFull
from zoo.models.text_completion import Pieces
from zoo.serve.choices import Choice, Events
from zoo.serve.replies import Reply, sse
from zoo.serve.requests import BadRequest, Parsed, chat_request, completion_request
from zoo.serve.served import Served

KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         429: "rate_limit_error", 500: "server_error", 503: "server_error"}  # fmt: skip


def create_app(served: Served, api_key: str | None = None) -> FastAPI:
    """The application that answers for `served`; every route asks for `api_key` (as
    `Authorization: Bearer KEY`) where one is given."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        served.engine.stop()

    app = FastAPI(title="zoo.serve", lifespan=lifespan)
    app.state.served = served
    if api_key is not None:
        app.add_middleware(KeyRequired, api_key=api_key)

    @app.exception_handler(BadRequest)
    async def refused(request: Request, e: BadRequest):
        return error(e)

    @app.exception_handler(HTTPException)
    async def not_found(request: Request, e: HTTPException):
        return error(
            BadRequest(f"{request.method} {request.url.path}: {e.detail}.", None, e.status_code)
        )

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(served)]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(served, completion_request(await body(request)), request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await answer(served, chat_request(await body(request)), request, chat=True)

    return app


class KeyRequired:
    """Refuses, with 401, an HTTP request without `Authorization: Bearer API_KEY`. A plain ASGI
    middleware: Starlette's `BaseHTTPMiddleware` would hide from the routes that their client
    went away (`Request.is_disconnected`), and a whole reply's rows would not be freed."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        given = dict(scope.get("headers", ())).get(b"authorization", b"")
        if scope["type"] == "http" and not hmac.compare_digest(given, self.expected):
            message = "A missing or wrong API key: send Authorization: Bearer KEY."
            await error(BadRequest(message, None, 401), "invalid_api_key")(scope, receive, send)
            return
        await self.app(scope, receive, send)


def model_card(served: Served) -> dict:
    return {"id": served.name, "object": "model", "created": 0, "owned_by": "zoo"}


def error(e: BadRequest, code: str | None = None) -> JSONResponse:
    kind = KINDS.get(e.status, "invalid_request_error")
    content = {"error": {"message": str(e), "type": kind, "param": e.param, "code": code}}
    return JSONResponse(content, status_code=e.status)


async def body(request: Request):
    try:
        return await request.json()
    except ValueError:
        raise BadRequest("The request body is not JSON.") from None


async def answer(served: Served, parsed: Parsed, request: Request, chat: bool):
    """The reply to a parsed request: its choices decoded in the running batch."""
    if parsed.model != served.name:
        message = (
            f"The model {parsed.model!r} does not exist here: this server serves {served.name!r}."
        )
        raise BadRequest(message, "model", 404)
    asks, lengths = served.asks(parsed)
    events = Events()
    try:
        events.tickets = served.engine.submit(asks, events.deliver)
    except QueueFull as e:
        raise BadRequest(str(e), None, 429) from None
    except EngineStopped as e:
        raise BadRequest(str(e), None, 503) from None
    # Ask k is choice k % n of prompt k // n: its text_offset counts from that prompt's start.
    starts = [len(parsed.prompts[k // parsed.n]) for k in range(len(asks))]
    choices = [Choice(Pieces(served.codec, parsed.stop), parsed.top_logprobs, at) for at in starts]
    reply = Reply(served.name, parsed, chat, choices, sum(lengths))
    if parsed.stream:
        return StreamingResponse(streamed(reply, events, served), media_type="text/event-stream")
    try:
        async for index, event in watched(events.each(choices), request, events):
            choices[index].add(event, served.codec)
    finally:
        events.cancel()
    if any(c.finish == "error" for c in choices):
        raise BadRequest(stopped(served), None, 500)
    return reply.whole()


def stopped(served: Served) -> str:
    return (
        f"The serving engine stopped after an error ({served.engine.failure}): restart the server."
    )


async def watched(each: AsyncIterator, request: Request, events: Events) -> AsyncIterator:
    """The events, while the client of a whole reply is still there (else its rows freed)."""
    waiting = asyncio.ensure_future(anext(each, None))
    while True:
        done, _ = await asyncio.wait({waiting}, timeout=0.5)
        if not done:
            if await request.is_disconnected():
                waiting.cancel()
                events.cancel()
                return
            continue
        item = waiting.result()
        if item is None:
            return
        yield item
        waiting = asyncio.ensure_future(anext(each, None))


async def streamed(reply: Reply, events: Events, served: Served) -> AsyncIterator[str]:
    """Server-sent events: a chunk per token (the text it releases, its log-probabilities),
    a chunk with each choice's finish_reason, usage where asked, then `[DONE]`. A client that
    goes away cancels this generator, and its rows are freed."""
    try:
        if reply.chat:
            for index in range(len(reply.choices)):
                yield sse(reply.opening(index))
        async for index, event in events.each(reply.choices):
            choice = reply.choices[index]
            piece, entry = choice.add(event, served.codec)  # a chunk per token, its text or ""
            if choice.finish == "error":  # the client raises it as an APIError
                yield sse({"error": {"message": stopped(served), "type": "server_error"}})
                return
            yield sse(reply.chunk(index, piece, entry, choice.finish))
        if reply.parsed.include_usage:
            yield sse({**reply.head(chunk=True), "choices": [], "usage": reply.usage()})
        yield "data: [DONE]\n\n"
    finally:
        events.cancel()

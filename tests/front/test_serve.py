"""`python -m zoo.serve`'s application, called through the `openai` client as users call it:
its replies are `zoo.generate`'s for the same settings (top_p and log-probabilities too), whole
or streamed; bad requests are refused with the server's message and the API's statuses, and
once its engine has failed, every request is answered 500 or 503 with the error; 32 clients at
once, with prompts and replies of every length, each get the reply they get alone, with no
compilation after warm-up; a client that goes away, streamed or not, frees its row
(tests/front/test_serve_queue.py: a full queue; tests/front/test_hub.py: a hub name served;
tests/front/test_finetune_chat.py: a chat run's workdir served with its template variables)."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import jax
import openai
import pytest
from helpers import ROOT, run_module, running
from zoo.models import serving_engine

import zoo
from zoo.serve import create_app

CHAT = str(ROOT / "tests" / "fixtures" / "pretrained" / "qwen3-chat")
KEY = "secret"
HELLO = [{"role": "user", "content": "Hello, who are you?"}]


@pytest.fixture(scope="module")
def server():
    app = create_app(CHAT, name="tiny", rows=4, max_length=256, queue_size=64, api_key=KEY)
    with running(app, KEY) as client:
        yield app, client


@pytest.fixture(scope="module")
def client(server):
    return server[1]


def streamed_text(stream) -> tuple[str, str]:
    """The text of a streamed choice, and its finish_reason."""
    pieces, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            delta = getattr(choice, "delta", None)
            pieces.append(choice.text if delta is None else delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(pieces), finish


def test_the_model_is_listed_under_its_name(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": 0.0},
        {"temperature": 0.9, "seed": 7},
        # A nucleus that changes the reply: without top_p, the same seed writes another text.
        {"temperature": 0.9, "seed": 7, "top_p": 0.3},
    ],
)
def test_completions_are_zoo_generates_whole_and_streamed(client, settings):
    prompt, expected = (
        "def main():\n    return",
        zoo.generate(CHAT, "def main():\n    return", max_new_tokens=24, **settings),
    )
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, **settings)
    assert reply.choices[0].text == expected
    assert reply.usage.completion_tokens == len(zoo.generate(
        CHAT, prompt, max_new_tokens=24, logprobs=True, **settings).tokens)  # fmt: skip
    stream = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=24, stream=True, **settings
    )
    assert streamed_text(stream)[0] == expected


def test_chat_replies_are_zoo_generates_with_log_probabilities(client):
    expected = zoo.generate(
        CHAT, messages=HELLO, max_new_tokens=20, temperature=0.8, seed=3, logprobs=True
    )
    reply = client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=20, temperature=0.8, seed=3, logprobs=True,
        top_logprobs=3,
    )  # fmt: skip
    choice = reply.choices[0]
    assert choice.message.content == expected.text
    assert choice.finish_reason == {"eos": "stop"}.get(expected.finish, expected.finish)
    logprobs = [entry.logprob for entry in choice.logprobs.content]
    assert logprobs == pytest.approx(expected.logprobs, abs=1e-5)
    assert all(len(entry.top_logprobs) == 3 for entry in choice.logprobs.content)
    stream = client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=20, temperature=0.8, seed=3, stream=True
    )
    assert streamed_text(stream)[0] == expected.text


def test_completion_log_probabilities_are_zoo_generates_in_the_legacy_layout(client):
    """`logprobs=N` on /v1/completions: each token's text, its log-probability (as
    `zoo.generate`'s), its N likeliest alternatives with the token itself (up to N + 1, as
    OpenAI's), and its offset from the start of the prompt; streamed, the same entries chunk
    by chunk."""
    prompt, settings = "Once upon a time", {"temperature": 0.8, "seed": 2}
    expected = zoo.generate(CHAT, prompt, max_new_tokens=12, logprobs=True, **settings)
    reply = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, logprobs=3, **settings
    )
    choice = reply.choices[0]
    said = choice.logprobs
    assert choice.text == expected.text
    assert said.token_logprobs == pytest.approx(expected.logprobs, abs=1e-5)
    assert "".join(said.tokens) == choice.text and len(said.tokens) == len(expected.tokens)
    assert said.text_offset == [
        len(prompt) + len("".join(said.tokens[:i])) for i in range(len(said.tokens))
    ]
    # Up to 3 alternatives and the token drawn, keyed by text (alike texts share a key).
    for token, logprob, top in zip(said.tokens, said.token_logprobs, said.top_logprobs):
        assert top[token] == logprob and 1 <= len(top) <= 4
    assert max(len(top) for top in said.top_logprobs) == 4
    stream = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=12, logprobs=3, stream=True, **settings
    )
    chunks = [c.choices[0].logprobs for c in stream if c.choices and c.choices[0].logprobs]
    for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in chunks for x in getattr(c, field)] == getattr(said, field)


def test_choices_are_zoo_generates_rows_and_stop_strings_cut_them(client):
    prompts = ["Once upon a time", "Once upon a time"]
    expected = zoo.generate(CHAT, prompts, max_new_tokens=16, temperature=1.0, seed=5)
    reply = client.completions.create(
        model="tiny", prompt=prompts[0], n=2, max_tokens=16, temperature=1.0, seed=5
    )
    assert [c.text for c in reply.choices] == expected
    cut = expected[0][2:4]
    reply = client.completions.create(
        model="tiny", prompt=prompts[0], max_tokens=16, temperature=1.0, seed=5, stop=[cut]
    )
    assert reply.choices[0].text == expected[0][: expected[0].find(cut)]
    assert reply.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("request_", "status", "said"),
    [
        ({"temperature": 3.0}, 400, "temperature=3.0 must be a number in [0.0, 2.0]"),
        ({"max_tokens": 0}, 400, "max_tokens=0 must be an integer of at least 1"),
        ({"prompt": "x" * 300}, 400, "give a prompt of at most 255 tokens"),
        ({"max_tokens": 300}, 400, "max_tokens=300 must lie between 1 and 256"),
        ({"model": "gpt-4"}, 404, "The model 'gpt-4' does not exist here"),
        ({"best_of": 2}, 400, "zoo.serve does not take best_of"),
        ({"top_k": 100_000}, 400, "top_k=100000 must lie between 0 (no limit) and"),
    ],
)
def test_a_bad_request_is_refused_with_the_servers_message(client, request_, status, said):
    body = {"model": "tiny", "prompt": "x", **request_}
    extra = {name: body.pop(name) for name in ("best_of", "top_k") if name in body}
    with pytest.raises(openai.APIStatusError) as raised:
        client.completions.create(**body, extra_body=extra)
    assert raised.value.status_code == status
    assert said in raised.value.message
    assert raised.value.body["param"] == next(iter(request_))
    assert raised.value.body["message"] == raised.value.message.split(" - ", 1)[1]


def test_a_request_without_the_api_key_is_refused(client):
    stranger = client.with_options(api_key="wrong")
    with pytest.raises(openai.AuthenticationError) as raised:
        stranger.models.list()
    assert raised.value.status_code == 401


def compilations() -> tuple[int, dict]:
    return COMPILED[0], dict(serving_engine.COMPILATIONS)


COMPILED = [0]


def counted(event: str, duration: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        COMPILED[0] += 1


def test_thirty_two_clients_at_once_each_get_their_reply_alone(client, fresh_compiles):
    """Prompts of 3 to 180 characters, replies of 1 to 40 tokens, greedy and sampled: the replies
    streamed to 32 clients at once are those each gets alone, and nothing is compiled (nor
    read from the compilation cache, which is off: every compilation is counted)."""
    asks = [
        {
            "prompt": "ab " * (1 + (i * 37) % 60),
            "max_tokens": 1 + (i * 13) % 40,
            "temperature": 0.0 if i % 2 else 0.9,
            "seed": i,
        }
        for i in range(32)
    ]
    alone = [client.completions.create(model="tiny", **ask).choices[0].text for ask in asks]
    jax.monitoring.register_event_duration_secs_listener(counted)
    before = compilations()
    start = threading.Barrier(32)

    def streaming(ask):
        start.wait()
        return streamed_text(client.completions.create(model="tiny", stream=True, **ask))[0]

    try:
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            together = list(pool.map(streaming, asks))
        assert compilations() == before
        jax.jit(lambda x: x + 1)(1.0)  # the listener counts: a new function compiles
        assert compilations()[0] == before[0] + 1
    finally:
        jax.monitoring.unregister_event_duration_listener(counted)
    assert together == alone


def test_a_client_that_goes_away_frees_its_row(server):
    app, client = server
    engine = app.state.served.engine
    cancelled = engine.stats()["cancelled"]
    streams = [
        client.completions.create(model="tiny", prompt="ab", max_tokens=200, stream=True)
        for _ in range(engine.rows)
    ]
    for stream in streams:
        next(iter(stream))
        stream.close()
    done = threading.Event()
    while not done.wait(0.05):
        if engine.stats()["busy"] == 0:
            done.set()
    assert engine.stats()["cancelled"] == cancelled + engine.rows
    reply = client.completions.create(model="tiny", prompt="ab", max_tokens=4, temperature=0.0)
    assert reply.choices[0].finish_reason in ("length", "stop")


def test_a_client_of_a_whole_reply_that_goes_away_frees_its_row(server, monkeypatch):
    """A non-streaming client that gives up (its timeout) while its reply is being written: the
    server sees it gone and the engine frees its row rather than writing the reply out. The
    engine's decode steps wait at a gate meanwhile, so the reply cannot end first."""
    app, client = server
    engine = app.state.served.engine
    cancelled, gate, step = engine.stats()["cancelled"], threading.Event(), engine._step

    def gated():
        gate.wait()
        return step()

    monkeypatch.setattr(engine, "_step", gated)
    try:
        with pytest.raises(openai.APITimeoutError):
            client.with_options(timeout=1.0).completions.create(
                model="tiny", prompt="ab", max_tokens=200
            )
        (ticket,) = [t for t in engine._held if t is not None]
        for _ in range(600):  # the server looks every half second: 30 s at most
            if ticket.cancelled:
                break
            time.sleep(0.05)
        assert ticket.cancelled, "the server did not see its client go away"
    finally:
        gate.set()
    done = threading.Event()
    while not done.wait(0.05):
        if engine.stats()["busy"] == 0:
            done.set()
    assert engine.stats()["cancelled"] == cancelled + 1
    assert len(ticket.tokens) == 1  # the prefill's token, and no step after it


def test_once_the_engine_has_failed_requests_get_500_then_503_with_its_error(monkeypatch):
    """An engine whose decode step raises: the request it holds is answered 500, the next one
    503 (refused before it is queued), each in the API's error shape with the error named. Its
    own app (the shapes of tests/front/test_serve_queue.py's, compiled once in a session): the
    shared server keeps working."""
    app = create_app(CHAT, name="tiny", rows=1, max_length=64, queue_size=2)
    engine = app.state.served.engine

    def broken():
        raise RuntimeError("a decode step that fails")

    monkeypatch.setattr(engine, "_step", broken)
    with running(app) as client:
        with pytest.raises(openai.InternalServerError) as held:
            client.completions.create(model="tiny", prompt="ab", max_tokens=8)
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model="tiny", prompt="ab", max_tokens=8)
    assert (held.value.status_code, refused.value.status_code) == (500, 503)
    said = "The serving engine stopped after an error (RuntimeError: a decode step that fails)"
    for raised in (held.value, refused.value):
        assert raised.body["type"] == "server_error"
        assert raised.body["message"].startswith(said + ": restart")


def test_the_command_refuses_a_bad_option_in_one_line():
    result = run_module("zoo.serve", CHAT, "rows=many")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: rows='many' is not a number: rows takes an integer."

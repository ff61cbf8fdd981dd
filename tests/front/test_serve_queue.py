"""A `zoo.serve` whose queue is full answers 429 in the API's error shape, and loses none of
the requests it accepted: each of them gets the reply it gets alone."""

from __future__ import annotations

import concurrent.futures
import threading

import openai
from helpers import ROOT, running

from zoo.serve import create_app

CHAT = str(ROOT / "tests" / "fixtures" / "pretrained" / "qwen3-chat")


def test_a_full_queue_answers_429_and_loses_no_accepted_request():
    app = create_app(CHAT, name="tiny", rows=1, max_length=64, queue_size=2)
    asks = [{"prompt": "ab" * (1 + i % 4), "max_tokens": 40, "seed": i} for i in range(10)]
    with running(app) as client:
        alone = [client.completions.create(model="tiny", **ask).choices[0].text for ask in asks]
        start = threading.Barrier(len(asks))

        def at_once(ask):
            start.wait()
            try:
                return client.completions.create(model="tiny", **ask).choices[0].text
            except openai.RateLimitError as e:
                return e

        with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:
            replies = list(pool.map(at_once, asks))
    refused = [r for r in replies if isinstance(r, openai.RateLimitError)]
    assert refused, "ten requests at once for one row and a queue of two"
    assert all(r.status_code == 429 and "The server is busy" in r.message for r in refused)
    assert all(r.body["type"] == "rate_limit_error" for r in refused)
    accepted = [(r, a) for r, a in zip(replies, alone, strict=True) if isinstance(r, str)]
    assert len(accepted) >= 3
    assert all(reply == reply_alone for reply, reply_alone in accepted)

"""The continuous-batching engine beneath `zoo.serve` (its HTTP behaviour:
tests/front/test_serve.py): an error in its thread ends every request it holds or queues
with an `error` event, and later requests are refused by name, none left waiting."""

from __future__ import annotations

import threading

import pytest
from helpers import ROOT
from zoo.models.serving_engine import Ask, Engine, EngineStopped, Finished

from zoo.text_generation import resolved

CHAT = str(ROOT / "tests" / "fixtures" / "pretrained" / "qwen3-chat")


def test_an_error_in_the_engine_ends_every_request_and_refuses_the_next():
    _, module, codec, _, activate = resolved(CHAT)
    engine = Engine(module, rows=1, max_length=32, queue_size=2, context=activate)
    engine.start()
    ends: dict[int, str] = {}
    ended = threading.Event()

    def deliver(index: int, event) -> None:
        if isinstance(event, Finished):
            ends[index] = event.reason
            if len(ends) == 2:
                ended.set()

    def broken(tokens: list[int]) -> bool:
        raise RuntimeError("a stop check that fails")

    prompt = codec.encode("ab")
    engine.submit([Ask(prompt, 8, stop=broken), Ask(prompt, 8)], deliver)
    ended.wait()
    assert ends == {0: "error", 1: "error"}
    with pytest.raises(EngineStopped, match="RuntimeError: a stop check that fails"):
        engine.submit([Ask(prompt, 8)], deliver)

"""The continuous-batching engine beneath `zoo.serve` (its HTTP behaviour:
tests/front/test_serve.py): a prompt longer than half a row leaves the reply every slot after
its own, and the reply is `zoo.generate`'s, with full and sliding-window (ring) caches; an error
in its thread ends every request it holds or queues with an `error` event, and later requests
are refused by name, none left waiting."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers import ROOT
from zoo.models.sampling_loop import Sampling
from zoo.models.serving_engine import Ask, Engine, EngineStopped, Finished, Token

import zoo
from zoo.text_generation import resolved

PRETRAINED = ROOT / "tests" / "fixtures" / "pretrained"
CHAT = str(PRETRAINED / "qwen3-chat")


def replies(engine: Engine, asks: list[Ask]) -> list[list[Token]]:
    """Each ask's tokens, all submitted at once."""
    tokens: list[list[Token]] = [[] for _ in asks]
    ended = threading.Semaphore(0)

    def deliver(index: int, event) -> None:
        if isinstance(event, Token):
            tokens[index].append(event)
        else:
            assert event.reason == "length", event
            ended.release()

    engine.submit(asks, deliver)
    for _ in asks:
        ended.acquire()
    return tokens


@pytest.mark.parametrize("name", ["qwen3-chat", "gemma3-chat"])  # gemma3's windows are rings
def test_a_prompt_longer_than_half_a_row_has_every_slot_after_it(name):
    """A 40-token prompt (padded to 64) in rows of 64 slots: 25 new tokens, greedy and sampled,
    beside a short prompt; each reply is `zoo.generate`'s for that prompt alone."""
    _, module, _, _, activate = resolved(str(PRETRAINED / name))
    engine = Engine(module, rows=2, max_length=64, queue_size=1, context=activate)
    engine.start()
    try:
        long, short = np.arange(3, 43, dtype=np.int32), np.arange(5, 9, dtype=np.int32)
        assert engine.room(len(long)) == 25
        asks = [
            Ask(long, 25, Sampling(temperature=0.0)),
            Ask(long, 25, Sampling(temperature=0.9), seed=4),
            Ask(short, 30, Sampling(temperature=0.0)),
        ]
        got = replies(engine, asks)
    finally:
        engine.stop()
    for ask, reply in zip(asks, got, strict=True):
        expected = zoo.generate(
            str(PRETRAINED / name), ask.prompt, max_new_tokens=ask.max_new_tokens, eos=(),
            temperature=ask.sampling.temperature, seed=ask.seed, logprobs=True,
        )  # fmt: skip
        assert [t.token for t in reply] == list(expected.tokens)
        assert [t.logprob for t in reply] == pytest.approx(list(expected.logprobs), abs=1e-5)


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

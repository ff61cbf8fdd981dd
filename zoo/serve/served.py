"""The model a server answers with: loaded as `zoo.generate` loads it (a run's workdir, a
pretrained directory or a hub name; its tokenizer, end-of-sequence ids, mesh and precision), its
engine started, and a parsed request turned into the engine's rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from zoo.engine.errors import ZooError
from zoo.models.sampling_loop import Sampling
from zoo.models.serving_engine import Ask, Engine
from zoo.models.text_completion import Codec, stop_check
from zoo.serve.requests import BadRequest, Parsed
from zoo.text_generation import chat_prompt, resolved


@dataclasses.dataclass
class Served:
    """A model under its `name`, its `codec` and default end-of-sequence ids, and its
    running `engine`."""

    name: str
    trained: Any
    codec: Codec
    eos: tuple[int, ...]
    engine: Engine

    @classmethod
    def start(cls, model: Any, name: str, rows: int, max_length: int, queue_size: int) -> Served:
        """Load `model` (a path or hub name, or a loaded run) as `zoo.generate` does, and
        start its engine, compiled."""
        trained, module, codec, eos, activate = resolved(model)
        engine = Engine(module, rows, max_length, queue_size, context=activate)
        engine.start()
        return cls(name, trained, codec, eos, engine)

    def asks(self, parsed: Parsed) -> tuple[list[Ask], list[int]]:
        """The rows a request asks for (its prompts' choices, prompt by prompt) and each
        prompt's length in tokens."""
        codec, eos = self.codec, self.eos
        prompts = parsed.prompts
        if parsed.messages:
            try:
                text, eos = chat_prompt(self.trained, parsed.messages, parsed.template_kwargs)
            except ZooError as e:
                raise BadRequest(str(e), "messages") from None
            codec, prompts = dataclasses.replace(codec, rendered=True), (text,)
        ids = [self._ids(codec, prompt) for prompt in prompts]
        sampling = Sampling(**parsed.sampling)
        try:  # the one control whose range is the model's: top_k, up to its vocabulary
            sampling.check(self.engine.model.vocab_size)
        except ZooError as e:
            raise BadRequest(str(e), "top_k") from None
        check = stop_check(parsed.stop, codec)
        asks = []
        for i, prompt in enumerate(ids):
            room = self.engine.room(len(prompt)) if len(prompt) < self.engine.max_length else 0
            new = parsed.max_tokens or max(room, 1)
            for j in range(parsed.n):
                asks.append(
                    Ask(prompt, new, sampling, parsed.seed, i * parsed.n + j, frozenset(eos), check)
                )
            self._check(asks[-1], parsed)
        return asks, [len(p) for p in ids]

    def _check(self, ask: Ask, parsed: Parsed) -> None:
        """The engine's refusal of a row, as a bad request naming the field to change."""
        try:
            self.engine.check(ask)
        except ZooError as e:
            fits = len(ask.prompt) < self.engine.max_length
            field = "max_tokens" if fits else "messages" if parsed.messages else "prompt"
            raise BadRequest(str(e), field) from None

    def _ids(self, codec: Codec, prompt: str) -> np.ndarray:
        ids = codec.encode(prompt)
        vocab = self.engine.model.vocab_size
        if len(ids) and int(ids.max()) >= vocab:
            raise BadRequest(
                f"The tokenizer gives id {int(ids.max())}, beyond the model's vocabulary of "
                f"{vocab}: the checkpoint's tokenizer does not match its model.",
                "prompt",
            )
        return ids

"""zoo's language models as an lm-evaluation-harness model (`lm_eval.api.model.LM`),
registered with its registry as `zoo`: `lm_eval --model zoo --model_args pretrained=DIR` in a
process that imported zoo, `zoo.evaluate_lm` and `python -m zoo.eval` everywhere.

It answers the harness's three requests as its Hugging Face backend (`hf`) does, so that a
task's numbers compare with those the harness reports for the same checkpoint in transformers:

- `loglikelihood`: a continuation's log-probability after its context, and whether each of
  its tokens was the likeliest, from forward passes over batches of rows sorted by length and
  padded on the right to `prompt_bucket`'s powers of two (a causal model's scores of a row are
  those of the row alone), so that a task compiles a few shapes, not one per request;
- `loglikelihood_rolling`: a text's log-likelihood in windows of `max_length` tokens, the first
  after the prefix token, as the harness cuts them (`get_rolling_token_windows`);
- `generate_until`: `zoo.generate`'s reply (its KV-cache engine), greedy unless the task samples,
  cut at the task's `until` strings and the checkpoint's end-of-sequence ids, without the
  special tokens it wrote (`<|end_header_id|>`), which the `hf` backend leaves out.

Texts are encoded as the checkpoint's tokenizer encodes them by default (Llama 3 prepends BOS,
Qwen adds nothing); a byte-level model reads UTF-8 bytes. The prefix token that stands before a
text with no context is the tokenizer's BOS, else its EOS (`tokenizer_config.json`), else the
first end-of-sequence id of the checkpoint, else the first id of a newline.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from lm_eval import simple_evaluate
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.tasks import TaskManager
from lm_eval.utils import (
    get_rolling_token_windows,
    handle_non_serializable,
    make_disjoint_window,
    simple_parse_args_string,
)

from zoo.chat_template import special_tokens
from zoo.data.text import load_tokenizer
from zoo.engine import sharding, steps
from zoo.engine.errors import ZooError
from zoo.engine.loop import RunResult
from zoo.loading import load
from zoo.models.sampling_loop import Completion, prompt_bucket
from zoo.pretrained import run_tokenizer
from zoo.text_generation import checkpoint_dir, checkpoint_eos, generate
from zoo.trained import TrainedModel

__all__ = ["TaskManager", "ZooLM", "handle_non_serializable", "simple_evaluate"]
"""The model, and the harness's parts that `zoo.lm_evaluation` uses, which imports them here,
where lm-eval (an extra) is first needed."""

SAMPLING_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p", "min_p")
"""The `generation_kwargs` of a task that `generate_until` reads."""


@nnx.jit
def _token_scores(model: nnx.Module, ids: jax.Array, targets: jax.Array) -> Any:
    """Each position's log-probability of its target token, and whether it was the likeliest,
    over the model's vocabulary alone (rows past `vocab_size` padded for sharding left out)."""
    logits = model(ids)
    logits = logits[..., : model.vocab_size].astype(jnp.float32)
    scores = jax.nn.log_softmax(logits, axis=-1)
    # A mask, not a gather: the vocabulary axis may be split over the mesh (`tensor`).
    hit = jnp.arange(scores.shape[-1]) == targets[..., None]
    chosen = jnp.where(hit, scores, 0.0).sum(axis=-1)
    return chosen, scores.max(axis=-1) == chosen


@register_model("zoo")
class ZooLM(TemplateLM):
    """A zoo language model (a run, a workdir, a pretrained directory or an `hf://` name) for
    the harness. `batch_size` rows per forward pass and per generation batch; `max_length`
    tokens of context at most (default: the model's `context_length`); `max_gen_toks` new
    tokens when a task names none; `seed` for tasks that sample."""

    def __init__(
        self,
        pretrained: str | os.PathLike | TrainedModel | RunResult,
        batch_size: int | str = 8,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        step: str | int = "latest",
        seed: int = 0,
    ):
        super().__init__()
        if isinstance(pretrained, str | os.PathLike):
            pretrained = load(pretrained, step, devices=jax.devices()[:1])
        _require_language_model(pretrained)
        self.trained = pretrained
        self.batch_size = _positive("batch_size", batch_size)
        self.max_length = _positive(
            "max_length", max_length if max_length is not None else pretrained.model.context_length
        )
        self.max_gen_toks, self.seed = _positive("max_gen_toks", max_gen_toks), int(seed)
        config = pretrained.config
        path = run_tokenizer(config, pretrained.workdir)
        self._tokenizer = load_tokenizer(path) if path else None
        with pretrained.activate():
            self._model = steps.computing(pretrained.model, config.trainer.precision)
        self._prefix = self._special_id(("bos_token", "eos_token"))
        self._prefix_text = (
            self._tokenizer.decode([self._prefix], skip_special_tokens=False)
            if self._tokenizer
            else None
        )

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """From the harness's command line (`--model_args pretrained=DIR,...`, `--batch_size`)."""
        given = {k: v for k, v in (additional_config or {}).items() if v is not None}
        batch = {"batch_size": given["batch_size"]} if "batch_size" in given else {}
        return cls(**simple_parse_args_string(arg_string), **batch)

    def _special_id(self, names: tuple[str, ...]) -> int:
        """The id of the first of the tokenizer's special tokens `names` it has
        (`tokenizer_config.json`), else the checkpoint's first end-of-sequence id, else a
        newline's first id (a byte for a byte-level model)."""
        if self._tokenizer is None:
            return ord("\n")
        directory = checkpoint_dir(self.trained)
        named = special_tokens(directory) if directory else {}
        for name in names:
            if named.get(name) and (found := self._tokenizer.token_to_id(named[name])) is not None:
                return found
        eos = checkpoint_eos(self.trained)
        return eos[0] if eos else self._tokenizer.encode("\n", add_special_tokens=False).ids[0]

    @property
    def eot_token_id(self) -> int:
        return self._special_id(("eos_token",))

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **_) -> list[int]:
        """The text's ids as the tokenizer gives them by default (with its special tokens),
        unless the text starts with the prefix token's own text, or as `add_special_tokens`
        says."""
        if self._tokenizer is None:
            return list(string.encode())
        if add_special_tokens is None:
            add_special_tokens = not (self._prefix_text and string.startswith(self._prefix_text))
        return self._tokenizer.encode(string, add_special_tokens=add_special_tokens).ids

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **_):
        answers = self._scores([(ctx, cont) for _, ctx, cont in requests])
        for (pair, _, _), answer in zip(requests, answers, strict=True):
            self.cache_hook.add_partial("loglikelihood", pair, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        owners, windows = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            cut = get_rolling_token_windows(self.tok_encode(text), self._prefix, self.max_length, 1)
            for window in map(make_disjoint_window, cut):
                owners.append(index)
                windows.append(window)
        totals = [0.0] * len(requests)
        for owner, (score, _) in zip(owners, self._scores(windows), strict=True):
            totals[owner] += score
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def _scores(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log-likelihood, greedy) of each continuation after its context, the pair cut to
        its last `max_length` + 1 tokens; the longest rows first, `batch_size` at a time."""
        rows = [(list(ctx) + list(cont))[-(self.max_length + 1) :] for ctx, cont in pairs]
        spans = [min(len(cont), len(row) - 1) for (_, cont), row in zip(pairs, rows, strict=True)]
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
        answers: list[tuple[float, bool]] = [(0.0, True)] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            chosen, greedy = self._forward([rows[i] for i in chunk])
            for j, i in enumerate(chunk):
                end = len(rows[i]) - 1
                scored = slice(end - spans[i], end)
                answers[i] = (float(chosen[j, scored].sum()), bool(greedy[j, scored].all()))
        return answers

    def _forward(self, rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Per-token scores of rows (inputs: all but the last token; targets: all but the
        first), padded to `batch_size` rows of the bucket of the longest."""
        shards = sharding.batch_divisor(self.trained.mesh, self.trained.rules)
        height = -(-self.batch_size // shards) * shards
        width = prompt_bucket(max(len(r) for r in rows) - 1, self.max_length)
        ids = np.zeros((height, width), np.int32)
        targets = np.zeros((height, width), np.int32)
        for j, row in enumerate(rows):
            ids[j, : len(row) - 1], targets[j, : len(row) - 1] = row[:-1], row[1:]
        with self.trained.activate():
            batch = sharding.shard_batch(
                {"inputs": ids, "targets": targets}, self.trained.mesh, self.trained.rules
            )
            scores = _token_scores(self._model, batch["inputs"], batch["targets"])
        return tuple(np.asarray(x) for x in jax.device_get(scores))

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Replies grouped by their generation settings, `batch_size` prompts a batch, each
        prompt cut to its last `max_length - max_gen_toks` tokens."""
        groups: dict[str, list[int]] = defaultdict(list)
        for index, request in enumerate(requests):
            groups[json.dumps(request.args[1], sort_keys=True, default=str)].append(index)
        replies = [""] * len(requests)
        for indices in groups.values():
            settings = self._generation_settings(requests[indices[0]].args[1])
            room = max(self.max_length - settings["max_new_tokens"], 1)
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start : start + self.batch_size]
                prompts = [
                    np.asarray(self.tok_encode(requests[i].args[0])[-room:], np.int32)
                    for i in chunk
                ]
                done = generate(self.trained, prompts, seed=self.seed, logprobs=True, **settings)
                for i, row in zip(chunk, done, strict=True):
                    text = self._reply(row, settings["stop"])
                    replies[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return replies

    def _reply(self, row: Completion, stops: list[str]) -> str:
        """A row's text as the harness's `hf` backend gives it: its tokens decoded without
        the special tokens among them (`zoo.generate` writes them out), cut at the first stop."""
        if self._tokenizer is None:
            return row.text
        text = self._tokenizer.decode(row.tokens, skip_special_tokens=True)
        ends = [text.find(stop) for stop in stops if stop and stop in text]
        return text[: min(ends)] if ends else text

    def _generation_settings(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """A task's `generation_kwargs` as `zoo.generate` takes them: greedy unless
        `do_sample` (at `temperature`, 1 if none or 0)."""
        unknown = sorted(set(kwargs) - set(SAMPLING_KWARGS))
        if unknown:
            raise ZooError(
                f"generation_kwargs {', '.join(map(repr, unknown))} of a generate_until task are "
                f"not options of zoo's model: it takes {', '.join(SAMPLING_KWARGS)}."
            )
        until = kwargs.get("until") or []
        temperature = float(kwargs.get("temperature") or 0.0)
        sampled = bool(kwargs.get("do_sample", temperature > 0))
        return {
            "stop": [until] if isinstance(until, str) else list(until),
            "max_new_tokens": int(kwargs.get("max_gen_toks", self.max_gen_toks)),
            "temperature": (temperature or 1.0) if sampled else 0.0,
            "top_k": int(kwargs.get("top_k") or 0),
            "top_p": float(kwargs.get("top_p") or 1.0),
            "min_p": float(kwargs.get("min_p") or 0.0),
        }


def _require_language_model(trained: TrainedModel | RunResult) -> None:
    model = trained.model
    if not all(hasattr(model, n) for n in ("vocab_size", "context_length", "decode")):
        raise ZooError(
            f"lm-evaluation-harness scores language models (gpt, decoder): the model of "
            f"{trained.workdir} is a {trained.config.model.name} ({type(model).__name__})."
        )


def _positive(name: str, value: Any) -> int:
    """A count option, from Python or the command line's text; refused by name otherwise."""
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = 0
    if count < 1 or (isinstance(value, float) and value != count):
        raise ZooError(f"{name}={value!r} is not a positive whole number: give e.g. {name}=8.")
    return count

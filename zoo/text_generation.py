"""`zoo.generate(model, prompt, ...)`: the text a language model writes after a prompt, or
the reply of a chat checkpoint to `messages`, through the model's own tokenizer.

`model` is a run (`RunResult`, `TrainedModel`), a workdir or a pretrained directory, a Hugging
Face Hub name (`hf://ORG/NAME[@REVISION]`, read through the hub's cache: `zoo.hub`), or a bare
module. A run's model is called under its own mesh and speaks its data set's tokenizer
(`data.tokenizer`, which a run from a pretrained directory takes from it; where that file is
gone, the copy the run kept in its workdir), and stops at its checkpoint's end-of-sequence ids
(`generation_config.json`); a bare module is byte-level unless `tokenizer` is given, and is
called under the mesh the caller activated. A run trained with `trainer.precision=bf16`
generates in bfloat16, as it trained. The engine: `zoo.models.sampling_loop`; the command line:
`python -m zoo.generate` (`zoo/generate/`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from omegaconf import DictConfig, OmegaConf

from zoo.chat_template import (
    end_of_turn_ids,
    read_chat_template,
    render_chat,
    special_tokens,
    template_variables,
)
from zoo.data.text import load_tokenizer
from zoo.engine import steps
from zoo.engine.errors import ZooError
from zoo.engine.loop import RunResult
from zoo.loading import load
from zoo.models.sampling_loop import Completion, Sampling
from zoo.models.text_completion import Codec, Request, complete
from zoo.models.text_completion import stream as _stream
from zoo.pretrained import run_tokenizer
from zoo.trained import TrainedModel

log = logging.getLogger("zoo")


def generate(
    model: Any,
    prompt: str | bytes | np.ndarray | Sequence[str | bytes | np.ndarray] | None = None,
    max_new_tokens: int = 100,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int | jax.Array = 0,
    *,
    top_p: float = 1.0,
    min_p: float = 0.0,
    stop: str | Sequence[str] = (),
    eos: Sequence[int] | None = None,
    logprobs: bool = False,
    stream: bool = False,
    tokenizer: Any = None,
    messages: Sequence[Mapping[str, Any]] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str | list[str] | Completion | list[Completion] | Iterator[str]:
    """The text that `model` writes after `prompt`: at most `max_new_tokens` new tokens
    (bytes, for a byte-level model), the likeliest each time at `temperature` 0, else sampled
    among the `top_k` likeliest (0: all), the fewest likeliest holding `top_p` of the
    probability (1: all), and those at least `min_p` times as likely as the likeliest (0: all);
    the same `seed` (an int or a JAX key) gives the same text.

    `prompt` may also be token ids (a 1-D array of ints), or a list of prompts, of any lengths: they are decoded in one batch, each as it
    would be alone, and a list of texts comes back. Each ends at its first `stop` string (cut
    from the text) or end-of-sequence id: `eos`, by default the checkpoint's
    (`generation_config.json`'s `eos_token_id`, for a model with a tokenizer; none for bytes).
    `logprobs`: `Completion`s instead of texts, with each new token's log-probability.
    `stream`: an iterator of the text's pieces as they come (one prompt).
    `tokenizer`: a `tokenizers.Tokenizer` or the path of a `tokenizer.json` (default: the run's
    own).

    `messages` instead of a prompt (`[{"role": "user", "content": ...}, ...]`): the reply of a
    chat checkpoint, its chat template rendered (`zoo.chat_template`, with the opening of the
    assistant's turn and the `chat_template_kwargs`, e.g. `{"enable_thinking": False}`) and the
    reply ending at its end-of-turn token (`eos`, by default `end_of_turn_ids`). A run's
    `data.template_kwargs` are the default `chat_template_kwargs`: a value given here that
    differs from the run's wins, with a warning naming both (`chat_variables`)."""
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    sampling = Sampling(temperature, top_k, top_p, min_p)
    if (messages is None) == (prompt is None):
        raise ZooError("zoo.generate takes a prompt or messages (a chat), one of the two.")
    trained, module, codec, default_eos, activate = resolved(model, tokenizer)
    if messages is not None:
        prompt, default_eos = chat_prompt(trained, messages, chat_template_kwargs)
        codec = dataclasses.replace(codec, rendered=True)  # the template wrote its BOS
    prompts = [prompt] if isinstance(prompt, str | bytes | np.ndarray) else list(prompt)
    if stream and len(prompts) != 1:
        raise ZooError(f"stream=True streams one prompt; got {len(prompts)}.")
    request = Request(
        max_new_tokens, sampling, seed, tuple(default_eos if eos is None else eos), stops, logprobs
    )
    with activate():
        if stream:
            return _streamed(_stream(module, prompts[0], request, codec), activate)
        done = complete(module, prompts, request, codec)
    out = done if logprobs else [row.text for row in done]
    return out[0] if isinstance(prompt, str | bytes | np.ndarray) else out


def _streamed(pieces: Iterator[str], activate) -> Iterator[str]:
    """The pieces, each computed under the model's mesh (a generator runs in its caller's
    context, outside the `with` it was made in)."""
    while True:
        with activate():
            piece = next(pieces, None)
        if piece is None:
            return
        yield piece


def resolved(model: Any, tokenizer: Any = None):
    """(the run or None, the module to call, its codec, its default end-of-sequence ids, the
    context to call it in: its run's mesh, or the caller's for a bare module)."""
    if isinstance(model, str | os.PathLike):
        model = load(model, devices=jax.devices()[:1])
    if isinstance(tokenizer, str | os.PathLike):
        tokenizer = load_tokenizer(tokenizer)
    if not isinstance(model, RunResult | TrainedModel):
        return None, model, Codec(tokenizer), (), contextlib.nullcontext
    if tokenizer is None and model.config.data.get("tokenizer"):
        tokenizer = load_tokenizer(run_tokenizer(model.config, model.workdir))
    eos = checkpoint_eos(model) if tokenizer is not None else ()
    with model.activate():
        computing = steps.computing(model.model, model.config.trainer.precision)
    return model, computing, Codec(tokenizer), eos, model.activate


def chat_prompt(
    model: RunResult | TrainedModel | None,
    messages: Sequence[Mapping[str, Any]],
    kwargs: Mapping[str, Any] | None = None,
) -> tuple[str, tuple[int, ...]]:
    """The text a chat checkpoint's model reads for `messages` before its reply (its template
    rendered with the generation prompt, its special tokens and `chat_variables`), and the ids
    that end the reply."""
    directory, template = _chat_template(model)
    variables = {**special_tokens(directory), **_variables(model, directory, template, kwargs)}
    return render_chat(template, messages, True, **variables), end_of_turn_ids(directory)


def chat_variables(
    model: RunResult | TrainedModel | None, given: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The chat template's variables besides the messages for a reply of `model`: those its run
    trained with (`data.template_kwargs`), so that it is asked in the format it learnt, and over
    them the caller's `given` (`chat_template_kwargs`, the chat's `template.NAME=VALUE`), each a
    variable the template reads (a misspelt one is refused by name, not ignored). A given value
    unlike the trained one wins, since switching (Qwen 3's thinking back on) may be meant, and
    is said in a warning naming both."""
    return _variables(model, *_chat_template(model), given)


def _variables(
    model: RunResult | TrainedModel,
    directory: str,
    template: str,
    given: Mapping[str, Any] | None,
) -> dict[str, Any]:
    given = dict(given or {})
    readable = template_variables(template) - {"messages", "add_generation_prompt"}
    unknown = sorted(map(str, set(given) - readable))
    if unknown:
        raise ZooError(
            f"The chat template of {directory} reads no variable named "
            f"{', '.join(map(repr, unknown))}: it reads {', '.join(sorted(readable))} "
            "(messages and add_generation_prompt are zoo's to set)."
        )
    trained = _trained_variables(model)
    for name in sorted(given.keys() & trained.keys()):
        if given[name] != trained[name]:
            said, learnt = f"{name}={given[name]!r}", f"{name}={trained[name]!r}"
            log.warning(
                "Chat template variable %s differs from the %s that the run in %s trained with "
                "(data.template_kwargs): the model is asked in a format it was not trained on. "
                "Rendering with %s.",
                said,
                learnt,
                model.workdir,
                said,
            )
    return {**trained, **given}


def _chat_template(model: RunResult | TrainedModel | None) -> tuple[str, str]:
    """The directory of the chat checkpoint `model` is or started from, and its template."""
    directory = None if model is None else checkpoint_dir(model)
    if directory is None:
        raise ZooError(
            "messages= needs a chat checkpoint (a pretrained directory, a hub name, or a run "
            "fine-tuned from one) whose chat template zoo reads; got a bare module or a run "
            "trained from scratch."
        )
    template = read_chat_template(directory)
    if template is None:
        raise ZooError(
            f"{directory} has no chat template (chat_template.jinja, or tokenizer_config.json's "
            "chat_template): give a prompt instead of messages."
        )
    return directory, template


def _trained_variables(model: RunResult | TrainedModel) -> dict[str, Any]:
    """The template variables the run trained with: its `data.template_kwargs` (none for a
    checkpoint directory or a run on other data)."""
    recorded = model.config.data.get("template_kwargs")
    return dict(OmegaConf.to_container(recorded) if isinstance(recorded, DictConfig) else {})


def checkpoint_dir(trained: RunResult | TrainedModel) -> str | None:
    """The checkpoint directory a run is (a pretrained directory) or started from."""
    finetune = trained.config.get("finetune") or {}
    for directory in (trained.workdir, finetune.get("init_from")):
        if directory and os.path.isfile(os.path.join(directory, "config.json")):
            return directory
    return None


def checkpoint_eos(trained: RunResult | TrainedModel) -> tuple[int, ...]:
    """The end-of-sequence ids of the checkpoint a run is or started from:
    `generation_config.json`'s `eos_token_id` (an id or a list), else `config.json`'s."""
    directory = checkpoint_dir(trained)
    if directory is not None:
        for name in ("generation_config.json", "config.json"):
            path = Path(directory) / name
            if path.is_file() and "eos_token_id" in (settings := json.loads(path.read_text())):
                listed = settings["eos_token_id"]
                return tuple(
                    listed if isinstance(listed, list) else [] if listed is None else [listed]
                )
    return ()

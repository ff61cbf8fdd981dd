"""What a language model (`gpt`, `decoder`) writes at each eval, its `on_eval` hook: a
continuation of held-out text, or its replies to a chat data set's held-out prompts, to
TensorBoard and the console (`zoo.models.text_completion` writes them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from zoo.models.sampling_loop import Sampling
from zoo.models.text_completion import Codec, Request, complete, generate, generate_tokens


def sample_on_eval(model: Any, report) -> None:
    """The `gpt` and decoders' eval hook. For a chat data set's held-out prompts
    (`report.prompts()`), the model's replies (`reply_on_eval`). Otherwise: continue the start
    of the first held-out example, written to TensorBoard (text `sample`) and the console;
    decoded by the data set's tokenizer, if the tokens are its ids."""
    if prompts := report.prompts():
        reply_on_eval(model, report, prompts)
        return
    tokens, length = report.examples["tokens"][0], int(report.examples["length"][0])
    prompt, tokenizer = tokens[: min(length, model.context_length // 2)], report.tokenizer
    new_tokens = model.context_length // 2
    if tokenizer is None:
        prompt = prompt.astype(np.uint8).tobytes()
        new = generate(model, prompt, new_tokens, temperature=0.8, seed=report.key)
        shown = prompt.decode("utf-8", errors="replace")
    else:
        ids = generate_tokens(model, prompt, new_tokens, temperature=0.8, seed=report.key)
        shown, new = tokenizer.decode(prompt.tolist()), tokenizer.decode(ids.tolist())
    report.text("sample", _as_markdown({"prompt": shown, "continuation": new}))
    report.log(f"sample @ step {report.step}: {shown!r} -> {new!r}")


def reply_on_eval(model: Any, report, prompts: Sequence[Any]) -> None:
    """The model's reply to each held-out prompt (`zoo.engine.report.reporter.ReplyPrompt`), the
    likeliest token each time (so that the replies of successive evals differ by what the model
    learned alone) up to an end-of-turn id, as `zoo.generate(model, messages=...,
    temperature=0)` writes it: TensorBoard text `replies/I` (the prompt, the reply, the
    reference reply) and a console line each. The prompts are decoded in one batch, each
    taking at most the fewest new tokens any of them may."""
    request = Request(
        max_new_tokens=min(p.max_new_tokens for p in prompts),
        sampling=Sampling(temperature=0.0),
        seed=report.key,
        eos=tuple(dict.fromkeys(i for p in prompts for i in p.end_of_turn)),
    )
    done = complete(model, [p.ids for p in prompts], request, Codec(report.tokenizer))
    for index, (prompt, row) in enumerate(zip(prompts, done)):
        shown = {"prompt": prompt.text, "reply": row.text, "reference": prompt.reference}
        report.text(f"replies/{index}", _as_markdown(shown))
        report.log(f"reply {index} @ step {report.step}: {row.text!r}")


def _as_markdown(parts: Mapping[str, str]) -> str:
    """Texts under their names as TensorBoard shows text: a code block each (indented, so any
    text is shown as it is, newlines and all)."""

    def block(text: str) -> str:
        return "\n".join("    " + line for line in text.splitlines() or [""])

    return "\n\n".join(f"**{name}**\n\n{block(text)}" for name, text in parts.items())

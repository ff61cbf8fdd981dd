"""Text from a language model: `zoo.generate(model, prompt, ...)`, and its CLI
`python -m zoo.generate DIR prompt=TEXT [max_new_tokens=100] [temperature=1.0] [top_k=0]
[seed=0] [step=latest]`.

`model` is a run (`RunResult`, `TrainedModel`), a workdir or a pretrained directory, a Hugging
Face Hub name (`hf://ORG/NAME[@REVISION]`, read through the hub's cache: `zoo.hub`), or a bare
module. A run's model is called under its own mesh and speaks its data set's tokenizer
(`data.tokenizer`, which a run from a pretrained directory takes from it; where that file is
gone, the copy the run kept in its workdir); a bare module is byte-level unless `tokenizer` is
given, and is called under the mesh the caller activated. A run trained with
`trainer.precision=bf16` generates in bfloat16, as it trained.
Sampling itself is `zoo.models.generate`.

(`zoo.generate` is the function once `import zoo` ran; the package's `__main__` is the CLI.)
"""

from __future__ import annotations

import os
import sys
from typing import Any

import jax

from zoo.api import TrainedModel, load
from zoo.data.text import load_tokenizer
from zoo.engine import precision
from zoo.engine.errors import ZooError
from zoo.engine.loop import RunResult
from zoo.models.generate import generate as generate_text
from zoo.pretrained import run_tokenizer

OPTIONS = {"prompt": str, "max_new_tokens": int, "temperature": float, "top_k": int, "seed": int}
USAGE = (
    "usage: python -m zoo.generate DIR prompt=TEXT [max_new_tokens=100] [temperature=1.0] "
    "[top_k=0] [seed=0] [step=latest|best|N]\n"
    "DIR: a run's workdir, a pretrained directory, or a Hugging Face Hub name hf://ORG/NAME"
)


def generate(
    model: Any,
    prompt: str | bytes,
    max_new_tokens: int = 100,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int | jax.Array = 0,
    *,
    tokenizer: Any = None,
) -> str:
    """The text that `model` writes after `prompt`: `max_new_tokens` new tokens (bytes, for a
    byte-level model), the likeliest each time at `temperature` 0, among the `top_k` likeliest
    if > 0; the same `seed` (an int or a JAX key) gives the same text. `tokenizer`: a
    `tokenizers.Tokenizer` or the path of a `tokenizer.json` (default: the run's own)."""
    if isinstance(model, str | os.PathLike):
        model = load(model, devices=jax.devices()[:1])
    if isinstance(tokenizer, str | os.PathLike):
        tokenizer = load_tokenizer(tokenizer)
    args = (prompt, max_new_tokens, temperature, top_k, seed)
    if not isinstance(model, RunResult | TrainedModel):
        return generate_text(model, *args, tokenizer=tokenizer)
    if tokenizer is None and model.config.data.get("tokenizer"):
        tokenizer = load_tokenizer(run_tokenizer(model.config, model.workdir))
    with model.activate():
        computing = precision.computing(model.model, model.config.trainer.precision)
        return generate_text(computing, *args, tokenizer=tokenizer)


def main(argv: list[str]) -> int:
    positional = [a for a in argv if "=" not in a]
    options = dict(a.split("=", 1) for a in argv if "=" in a)
    if len(positional) != 1 or "prompt" not in options or set(options) - {*OPTIONS, "step"}:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        step = options.pop("step", "latest")
        trained = load(positional[0], step, devices=jax.devices()[:1])
        print(options["prompt"] + generate(trained, **_typed(options)))
    except ZooError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _typed(options: dict[str, str]) -> dict[str, Any]:
    typed = {}
    for name, text in options.items():
        try:
            typed[name] = OPTIONS[name](text)
        except ValueError:
            raise ZooError(
                f"{name}={text!r} is not a number: {name} takes an {OPTIONS[name].__name__}."
            ) from None
    return typed

"""A terminal chat with a chat checkpoint, which keeps the conversation:
`python -m zoo.chat DIR [system=TEXT] [max_new_tokens=256] [temperature=0.7] [top_k=0]
[top_p=1.0] [min_p=0.0] [seed=0] [step=latest] [template.NAME=VALUE ...]`.

Each line read is the user's turn; the model's reply is printed as it comes, ending at its
end-of-turn token, and both join the conversation the next turn renders (`zoo.generate(model,
messages=...)`). An empty line, `/exit` or the end of the input ends the chat. `DIR` is a chat
checkpoint's directory, a hub name (`hf://ORG/NAME`), or the workdir of a run fine-tuned from
one. Turn i samples with seed + i. `template.NAME=VALUE` sets a chat template variable
(`template.enable_thinking=false`), its value typed as a run's overrides are; a run's own
`data.template_kwargs` are the default (`zoo.text_generation.chat_variables`). Each is checked
before the first turn.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import jax

from zoo.cli import command_line, load_plugins, typed_options
from zoo.engine.errors import ZooError
from zoo.loading import load
from zoo.overrides import typed_argument
from zoo.text_generation import chat_variables, generate

log = logging.getLogger("zoo")
DEFAULTS = {"max_new_tokens": 256, "temperature": 0.7, "seed": 0}
SAMPLING = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "seed")
TEMPLATE = "template."
USAGE = (
    "usage: python -m zoo.chat DIR [system=TEXT] [max_new_tokens=256] [temperature=0.7] "
    "[top_k=0] [top_p=1.0] [min_p=0.0] [seed=0] [step=latest|best|N] "
    "[template.NAME=VALUE ...]\n"
    "DIR: a chat checkpoint's directory, a hub name hf://ORG/NAME, or a run fine-tuned from one"
)


def main(argv: list[str], lines: TextIO = sys.stdin, out: TextIO = sys.stdout) -> int:
    once = _SaidOnce()
    log.addFilter(once)  # a conflicting template variable is said before the first turn only
    try:
        rest = [a for a in argv if not a.startswith(TEMPLATE)]
        positional, options = command_line(rest, USAGE, 1, {*SAMPLING, "system", "step"})
        load_plugins()
        variables = template_arguments([a for a in argv if a.startswith(TEMPLATE)])
        trained = load(positional[0], options.pop("step", "latest"), devices=jax.devices()[:1])
        chat_variables(trained, variables)  # refused or said before the first turn
        system = options.pop("system", None)
        settings = {**DEFAULTS, **typed_options(options)}
        messages = [] if system is None else [{"role": "system", "content": system}]
        chat(trained, messages, settings, lines, out, variables)
    except ZooError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        log.removeFilter(once)
    return 0


class _SaidOnce(logging.Filter):
    """Lets each message through the first time only: a chat renders its template, and says
    what it warns of, at every turn."""

    def __init__(self):
        super().__init__()
        self.said: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        first = message not in self.said
        self.said.add(message)
        return first


def template_arguments(arguments: list[str]) -> dict[str, Any]:
    """The chat template variables that `template.NAME=VALUE` arguments give."""
    variables = {}
    for argument in arguments:
        key, value = typed_argument(argument)
        name = key.removeprefix(TEMPLATE)
        if not name.isidentifier():
            raise ZooError(
                f"'{argument}' names no chat template variable: give template.NAME=VALUE, "
                "NAME one word that the checkpoint's chat template reads, e.g. "
                "template.enable_thinking=false."
            )
        if name in variables:
            raise ZooError(f"'{argument}': {key} is given twice; give each variable once.")
        variables[name] = value
    return variables


def chat(
    trained,
    messages: list[dict],
    settings: dict[str, Any],
    lines: TextIO,
    out: TextIO,
    variables: dict[str, Any] | None = None,
):
    """Turns until the input ends: each line the user's, each reply printed as it comes, the
    template rendered with `variables` over the run's own."""
    for turn in range(sys.maxsize):
        if lines.isatty():
            print("> ", end="", file=out, flush=True)
        line = lines.readline()
        if not line.strip() or line.strip() == "/exit":
            return
        messages.append({"role": "user", "content": line.rstrip("\n")})
        seed = settings["seed"] + turn
        reply = []
        for piece in generate(
            trained,
            **{**settings, "seed": seed},
            messages=messages,
            stream=True,
            chat_template_kwargs=variables,
        ):
            print(piece, end="", file=out, flush=True)
            reply.append(piece)
        print(file=out, flush=True)
        messages.append({"role": "assistant", "content": "".join(reply)})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

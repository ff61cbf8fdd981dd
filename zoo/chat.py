"""A terminal chat with a chat checkpoint, which keeps the conversation:
`python -m zoo.chat DIR [system=TEXT] [max_new_tokens=256] [temperature=0.7] [top_k=0]
[top_p=1.0] [min_p=0.0] [seed=0] [step=latest]`.

Each line read is the user's turn; the model's reply is printed as it comes, ending at its
end-of-turn token, and both join the conversation the next turn renders (`zoo.generate(model,
messages=...)`). An empty line, `/exit` or the end of the input ends the chat. `DIR` is a chat
checkpoint's directory, a hub name (`hf://ORG/NAME`), or the workdir of a run fine-tuned from
one. Turn i samples with seed + i.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

import jax

from zoo.api import load
from zoo.engine.errors import ZooError
from zoo.generate import generate, typed_options

DEFAULTS = {"max_new_tokens": 256, "temperature": 0.7, "seed": 0}
SAMPLING = ("max_new_tokens", "temperature", "top_k", "top_p", "min_p", "seed")
USAGE = (
    "usage: python -m zoo.chat DIR [system=TEXT] [max_new_tokens=256] [temperature=0.7] "
    "[top_k=0] [top_p=1.0] [min_p=0.0] [seed=0] [step=latest|best|N]\n"
    "DIR: a chat checkpoint's directory, a hub name hf://ORG/NAME, or a run fine-tuned from one"
)


def main(argv: list[str], lines: TextIO = sys.stdin, out: TextIO = sys.stdout) -> int:
    positional = [a for a in argv if "=" not in a]
    options = dict(a.split("=", 1) for a in argv if "=" in a)
    if len(positional) != 1 or set(options) - {*SAMPLING, "system", "step"}:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        trained = load(positional[0], options.pop("step", "latest"), devices=jax.devices()[:1])
        system = options.pop("system", None)
        settings = {**DEFAULTS, **typed_options(options)}
        messages = [] if system is None else [{"role": "system", "content": system}]
        chat(trained, messages, settings, lines, out)
    except ZooError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def chat(trained, messages: list[dict], settings: dict[str, Any], lines: TextIO, out: TextIO):
    """Turns until the input ends: each line the user's, each reply printed as it comes."""
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
            trained, **{**settings, "seed": seed}, messages=messages, stream=True
        ):
            print(piece, end="", file=out, flush=True)
            reply.append(piece)
        print(file=out, flush=True)
        messages.append({"role": "assistant", "content": "".join(reply)})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The command line of `zoo.generate` (the function: `zoo.text_generation`):
`python -m zoo.generate DIR prompt=TEXT [max_new_tokens=100] [temperature=1.0] [top_k=0]
[top_p=1.0] [min_p=0.0] [seed=0] [stop=TEXT] [step=latest]`, which prints the prompt, then the
text as it comes.

`DIR` is a run's workdir, a pretrained directory or a Hugging Face Hub name (`hf://ORG/NAME`);
`step` names the run's checkpoint (`latest`, `best` or a step number). A bad option is said in
one line and the command exits with status 2.

`import zoo` binds `zoo.generate` to the function and imports this package first, so that no
later `import zoo.generate` (nor `python -m zoo.generate`) rebinds the name to the package.
"""

from __future__ import annotations

import sys

import jax

from zoo.cli import GENERATE_OPTIONS, command_line, load_plugins, typed_options
from zoo.engine.errors import ZooError
from zoo.loading import load
from zoo.text_generation import generate

USAGE = (
    "usage: python -m zoo.generate DIR prompt=TEXT [max_new_tokens=100] [temperature=1.0] "
    "[top_k=0] [top_p=1.0] [min_p=0.0] [seed=0] [stop=TEXT] [step=latest|best|N]\n"
    "DIR: a run's workdir, a pretrained directory, or a Hugging Face Hub name hf://ORG/NAME"
)


def main(argv: list[str]) -> int:
    """Run the command on `argv` (without the program's name); its exit status."""
    try:
        names = {*GENERATE_OPTIONS, "step"}
        positional, options = command_line(argv, USAGE, 1, names, required=("prompt",))
        load_plugins()
        step = options.pop("step", "latest")
        trained = load(positional[0], step, devices=jax.devices()[:1])
        typed = typed_options(options)
        print(typed["prompt"], end="", flush=True)
        for piece in generate(trained, **typed, stream=True):
            print(piece, end="", flush=True)
        print()
    except ZooError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0

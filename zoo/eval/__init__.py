"""The command line of `zoo.evaluate_lm` (the function: `zoo.lm_evaluation`):
`python -m zoo.eval MODEL tasks=NAME[,NAME...] [num_fewshot=N] [limit=N] [batch_size=8]
[max_length=N] [include=DIR[,DIR...]] [output=FILE] [tensorboard=DIR] [step=latest|best|N]
[seed=0]`, which prints each task's metrics, one per line.

`MODEL` is a run's workdir, a pretrained directory or a Hugging Face Hub name (`hf://ORG/NAME`).
Each option is `zoo.evaluate_lm`'s keyword argument of its name; a bad one is said in one
paragraph and the command exits with status 2.
"""

from __future__ import annotations

import sys
from typing import Any

from zoo.cli import command_line, load_plugins
from zoo.engine.errors import ZooError
from zoo.lm_evaluation import evaluate_lm

USAGE = (
    "usage: python -m zoo.eval MODEL tasks=NAME[,NAME...] [num_fewshot=N] [limit=N] "
    "[batch_size=8] [max_length=N] [include=DIR[,DIR...]] [output=FILE] [tensorboard=DIR] "
    "[step=latest|best|N] [seed=0]\n"
    "MODEL: a run's workdir, a pretrained directory, or a Hugging Face Hub name hf://ORG/NAME"
)
OPTIONS = {
    "tasks": str,
    "num_fewshot": int,
    "limit": float,
    "batch_size": int,
    "max_length": int,
    "include": str,
    "output": str,
    "tensorboard": str,
    "step": str,
    "seed": int,
}
"""Each option's type as `zoo.evaluate_lm` takes it (`limit`: a count, or a fraction below 1)."""


def main(argv: list[str]) -> int:
    """Run the command on `argv` (without the program's name); its exit status."""
    try:
        positional, options = command_line(argv, USAGE, 1, OPTIONS, required=("tasks",))
        load_plugins()
        typed = _typed(options)
        metrics = evaluate_lm(positional[0], **typed)
    except ZooError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for task, values in metrics.items():
        for metric, value in values.items():
            print(f"{task} {metric} {value:.6g}")
    return 0


def _typed(options: dict[str, str]) -> dict[str, Any]:
    typed: dict[str, Any] = {}
    for name, text in options.items():
        try:
            typed[name] = OPTIONS[name](text)
        except ValueError:
            kind = OPTIONS[name].__name__
            raise ZooError(f"{name}={text!r} is not a number: {name} takes an {kind}.") from None
    if "limit" in typed and typed["limit"] >= 1:
        typed["limit"] = int(typed["limit"])
    if "include" in typed:
        typed["include"] = [folder for folder in typed["include"].split(",") if folder]
    return typed

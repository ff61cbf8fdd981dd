"""The command line of `zoo.export` (the function: `zoo.exporting`):
`python -m zoo.export WORKDIR OUT_DIR [format=hf|jax] [step=latest|best|N] [weights=raw|ema]
[dtype=float32|bfloat16] [max_shard_size=SIZE]`, which prints the path it wrote.

Each option is `zoo.export`'s keyword argument of its name; a bad one is said in one line and
the command exits with status 2.

`import zoo` binds `zoo.export` to the function and imports this package first, so that no
later `import zoo.export` (nor `python -m zoo.export`) rebinds the name to the package.
"""

from __future__ import annotations

import sys

from zoo.cli import command_line, load_plugins
from zoo.engine.errors import ZooError
from zoo.exporting import export

USAGE = (
    "usage: python -m zoo.export WORKDIR OUT_DIR [format=hf|jax] [step=latest|best|N] "
    "[weights=raw|ema] [dtype=float32|bfloat16] [max_shard_size=SIZE]"
)
OPTIONS = ("format", "step", "weights", "dtype", "max_shard_size")


def main(argv: list[str]) -> int:
    """Run the command on `argv` (without the program's name); its exit status."""
    try:
        positional, options = command_line(argv, USAGE, 2, OPTIONS)
        load_plugins()
        out = export(*positional, **options)
    except ZooError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0

"""The command line of `zoo.serve`: `python -m zoo.serve MODEL [host=127.0.0.1] [port=8000]
[rows=8] [max_length=512] [queue_size=64] [name=MODEL] [step=latest]`, which loads the model,
compiles its engine and answers until interrupted.

`MODEL` is a run's workdir, a pretrained directory or a Hugging Face Hub name (`hf://ORG/NAME`);
plugins as every zoo command (`$ZOO_PLUGINS`). It listens on 127.0.0.1 (this machine only)
unless `host` says otherwise. `$ZOO_API_KEY`, where set, is the key every request must send
(`Authorization: Bearer KEY`). A bad option is said in one line and the command exits with
status 2.
"""

from __future__ import annotations

import os
import sys

import jax

from zoo.cli import command_line, load_plugins
from zoo.engine.errors import ZooError
from zoo.loading import load

OPTIONS = {
    "host": str,
    "port": int,
    "rows": int,
    "max_length": int,
    "queue_size": int,
    "name": str,
    "step": str,
}
USAGE = (
    "usage: python -m zoo.serve MODEL [host=127.0.0.1] [port=8000] [rows=8] [max_length=512] "
    "[queue_size=64] [name=MODEL] [step=latest|best|N]\n"
    "MODEL: a run's workdir, a pretrained directory, or a Hugging Face Hub name hf://ORG/NAME; "
    "$ZOO_API_KEY: the key clients must send"
)


def main(argv: list[str]) -> int:
    """Run the command on `argv` (without the program's name); its exit status."""
    try:
        positional, options = command_line(argv, USAGE, 1, OPTIONS)
        typed = {name: _typed(name, text) for name, text in options.items()}
        import uvicorn

        from zoo.serve import create_app

        load_plugins()
        host, port = typed.pop("host", "127.0.0.1"), typed.pop("port", 8000)
        trained = load(positional[0], typed.pop("step", "latest"), devices=jax.devices()[:1])
        typed.setdefault("name", positional[0])
        app = create_app(trained, api_key=os.environ.get("ZOO_API_KEY") or None, **typed)
    except ZooError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=host, port=port, log_level="warning")
    return 0


def _typed(name: str, text: str):
    kind = OPTIONS[name]
    try:
        return kind(text)
    except ValueError:
        raise ZooError(f"{name}={text!r} is not a number: {name} takes an integer.") from None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

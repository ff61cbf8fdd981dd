"""What every command line of zoo shares (`python -m zoo.train`, `zoo.generate`, `zoo.export`,
`zoo.chat`, `zoo.eval`, `zoo.serve`): the plugin modules a user names in `$ZOO_PLUGINS`; how
the commands other than `zoo.train` (whose overrides are Hydra's) read their positional
arguments and `key=value` options; and what the two that generate text (`zoo.generate`,
`zoo.chat`) share: their options, typed as `zoo.generate(...)` takes them.

A run of a model that a project's own module registers is trained, loaded, exported and chatted
with by naming that module, the same way for each command: a command that skipped it would
know the run's model by a name it cannot build.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Collection
from typing import Any

from zoo.engine.errors import ZooError

PLUGINS_VARIABLE = "ZOO_PLUGINS"
GENERATE_OPTIONS = {
    "prompt": str,
    "max_new_tokens": int,
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "seed": int,
    "stop": str,
}
"""The `key=value` options of `python -m zoo.generate`, each the type of `zoo.generate`'s
keyword argument of its name (`zoo.chat` takes those of sampling)."""


def plugin_modules(variable: str = PLUGINS_VARIABLE) -> list[str]:
    """The module names in `$ZOO_PLUGINS`: comma-separated, blanks around them ignored."""
    return [name.strip() for name in os.environ.get(variable, "").split(",") if name.strip()]


def load_plugins(variable: str = PLUGINS_VARIABLE) -> None:
    """Import the modules named in `$ZOO_PLUGINS`, so that the models, data sets and checkpoint
    families they register exist; a `ZooError` naming a module that cannot be imported."""
    for module in plugin_modules(variable):
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ZooError(
                f"Cannot import plugin module '{module}' named in ${variable}: {e}. Name modules "
                "importable from the current directory, PYTHONPATH or the installed packages "
                "(comma-separated)."
            ) from None


def command_line(
    argv: list[str],
    usage: str,
    positional: int,
    options: Collection[str],
    required: Collection[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """A command's `positional` arguments and its `key=value` options (the first `=` splits);
    a `ZooError` naming what is wrong, followed by `usage`, where they are not what it takes."""
    given = [a for a in argv if "=" not in a]
    named = dict(a.split("=", 1) for a in argv if "=" in a)
    unknown = sorted(set(named) - set(options))
    missing = [name for name in required if name not in named]
    problem = None
    if unknown:
        asked = ", ".join(f"{name}={named[name]}" for name in unknown)
        problem = (
            f"{asked}: not an option of this command, which takes {', '.join(sorted(options))}."
        )
    elif missing:
        problem = f"{missing[0]}= is missing: this command needs it."
    elif len(given) != positional:
        problem = (
            f"{positional} positional argument(s) expected (those without '='), got "
            f"{len(given)}: {' '.join(given) or 'none'}."
        )
    if problem is not None:
        raise ZooError(f"{problem}\n{usage}")
    return given, named


def typed_options(options: dict[str, str]) -> dict[str, Any]:
    """Command-line `key=value` options as the types `GENERATE_OPTIONS` gives them."""
    typed = {}
    for name, text in options.items():
        kind = GENERATE_OPTIONS[name]
        try:
            typed[name] = kind(text)
        except ValueError:
            raise ZooError(
                f"{name}={text!r} is not a number: {name} takes an {kind.__name__}."
            ) from None
    return typed

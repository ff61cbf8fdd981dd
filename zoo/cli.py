"""What every command line of zoo shares (`python -m zoo.train`, `zoo.generate`, `zoo.export`,
`zoo.chat`): the plugin modules a user names in `$ZOO_PLUGINS`.

A run of a model that a project's own module registers is trained, loaded, exported and chatted
with by naming that module, the same way for each command: a command that skipped it would
know the run's model by a name it cannot build.
"""

from __future__ import annotations

import importlib
import os

from zoo.engine.errors import ZooError

PLUGINS_VARIABLE = "ZOO_PLUGINS"


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

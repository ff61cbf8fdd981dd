"""mkdocs hooks (mkdocs.yml `hooks:`): the API reference reads zoo's modules where their names say.

mkdocstrings reads source files, not imported modules, and finds a package by its folder: here
`zoo/` is `zoo`, but `zoo.engine`, `zoo.models` and `zoo.data` are the folders `train/`,
`models/` and `data/` (pyproject.toml's `package-dir`). The build reads a tree of links laid out
as the installed package is.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import tomllib
from pathlib import Path

from mkdocs.plugins import event_priority

ROOT = Path(__file__).resolve().parent.parent


def installed_layout(into: Path) -> Path:
    """Links under `into` that lay the repository's folders out as the package names them;
    returns `into`."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        package_dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    for name, folder in sorted(package_dirs.items(), key=lambda item: item[0].count(".")):
        target, place = ROOT / folder, into.joinpath(*name.split("."))
        if "." in name:
            place.symlink_to(target, target_is_directory=True)
        else:  # the top package: a folder of its own, since the reader follows the link
            # of an `__init__.py` back to the package's folder, where the others are not
            shutil.copytree(target, place, symlinks=True)
    return into


@event_priority(50)  # before mkdocstrings' own, which starts the handler
def on_config(config):
    layout = Path(tempfile.mkdtemp(prefix="zoo-docs-layout-"))
    atexit.register(shutil.rmtree, layout, ignore_errors=True)
    python = config.plugins["mkdocstrings"].config.handlers.setdefault("python", {})
    python["paths"] = [str(installed_layout(layout))]
    return config

"""The layering: `zoo` on top, the plugins `models` and `data` below it, the engine `train` at the
bottom, with no import cycles anywhere, so any module can be imported on its own, first."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys

from helpers import ROOT

PACKAGES = ("train", "models", "data", "zoo")
THIRD_PARTY = ("jax", "flax.nnx", "optax", "orbax.checkpoint", "grain", "hydra", "tensorboardX")


def project_modules() -> list[str]:
    modules = []
    for package in PACKAGES:
        modules.append(package)
        for info in pkgutil.iter_modules([str(ROOT / package)]):
            modules.append(f"{package}.{info.name}")
    return modules


# The parent loads the third-party libraries once, then forks one child per module: each child
# starts with no module of this project loaded and imports one of them first. A fresh
# interpreter per module would do the same at two seconds of library imports each.
FIRST_IMPORTS = """
import importlib, os, sys
for library in {third_party!r}:
    importlib.import_module(library)
assert not any(name.split(".")[0] in {packages!r} for name in sys.modules)
failed = []
for module in {modules!r}:
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(module)
        except BaseException as e:
            print(f"{{module}}: {{type(e).__name__}}: {{e}}", flush=True)
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status):
        failed.append(module)
print("failed:", failed)
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_on_its_own_first():
    modules = project_modules()
    assert len(modules) > 40 and "train.loop" in modules and "models.gpt" in modules
    script = FIRST_IMPORTS.format(third_party=THIRD_PARTY, packages=PACKAGES, modules=modules)
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_import_contracts_hold():
    """`lint-imports` checks the contracts in pyproject.toml: the layers zoo > models | data >
    train, and no cycles between the modules of any package."""
    result = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "lint-imports")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 2 kept, 0 broken." in result.stdout

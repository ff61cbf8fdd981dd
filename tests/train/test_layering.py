"""One import name and the layering under it: an installed zoo adds `zoo` and no other top-level
name, works from a project folder with its own `data.py`, `train.py` and `models/`, and keeps
its layers (the front on top, the plugins `zoo.models` and `zoo.data` below it, the engine
`zoo.engine` at the bottom) with no import cycles, so any module can be imported on its own,
first."""

from __future__ import annotations

import compileall
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import ROOT

THIRD_PARTY = (
    "jax",
    "flax.nnx",
    "optax",
    "orbax.checkpoint",
    "grain",
    "hydra",
    "tensorboardX",
    "pyarrow.compute",
    "pyarrow.parquet",
    "PIL.Image",
    "jinja2",
    "rich",
    "safetensors",
    # What zoo's modules load beyond the above: their submodules, qwix (LoRA, QLoRA), tarfile.
    "safetensors.numpy",
    "qwix",
    "jax.experimental.pallas",
    "tensorboardX.proto.plugin_hparams_pb2",
    "PIL.ImageDraw",
    "PIL.ImageFont",
    "PIL.ImageEnhance",
    "PIL.ImageFilter",
    "PIL.ImageStat",
    "jinja2.sandbox",
    "jinja2.meta",
    "rich.progress",
    "tarfile",
)
"""The libraries zoo imports, loaded once before the project's modules are imported one by one
(a library left out costs time, not strength: each child then imports it itself)."""
SOURCES = ("pyproject.toml", "README.md", "zoo", "models", "data", "train")
BUILD_WHEEL = (
    "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
)


def run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        args,
        cwd=cwd,
        env={**os.environ, "JAX_PLATFORMS": "cpu", **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """zoo's wheel, built by the project's build backend from a copy of this checkout (the
    backend leaves `build/` and `zoo.egg-info/` where it runs)."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(
                ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy(ROOT / name, source / name)
    built = run([sys.executable, "-c", BUILD_WHEEL, str(out)], cwd=source)
    assert built.returncode == 0, built.stderr
    return out / built.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel unpacked as an installer lays it into site-packages, byte-compiled as pip does
    (so that each of the many processes importing it does not compile it again)."""
    site = tmp_path_factory.mktemp("site-packages")
    zipfile.ZipFile(wheel).extractall(site)
    assert compileall.compile_dir(site, quiet=1)
    return site


def test_the_wheel_adds_one_top_level_name(wheel):
    names = {Path(name).parts[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {name for name in names if not name.endswith(".dist-info")} == {"zoo"}
    files = set(zipfile.ZipFile(wheel).namelist())
    assert {
        "zoo/engine/loop/trainer.py",
        "zoo/engine/kernels/bf16_rows.cc",
        "zoo/models/gpt.py",
        "zoo/data/text.py",
        "zoo/train.py",
    } <= files


INSTALLED_AS = {"zoo": "zoo", "models": "zoo/models", "data": "zoo/data", "train": "zoo/engine"}
"""Each folder of the repository, and where the wheel puts it."""


def test_the_wheel_holds_every_module_of_the_four_folders(wheel):
    """A subpackage left out of pyproject.toml's `packages`, or a C++ source out of its
    `package-data`, would be missing from installs."""
    files = set(zipfile.ZipFile(wheel).namelist())
    for folder, installed_as in INSTALLED_AS.items():
        for path in [*(ROOT / folder).rglob("*.py"), *(ROOT / folder).rglob("*.cc")]:
            name = f"{installed_as}/{path.relative_to(ROOT / folder).as_posix()}"
            assert name in files, f"{path.relative_to(ROOT)} is not in the wheel as {name}"


USER_PROJECT = {
    "data.py": "raise SystemExit('the project\\'s own data.py was imported')\n",
    "train.py": "raise SystemExit('the project\\'s own train.py was imported')\n",
    "models/__init__.py": "raise SystemExit('the project\\'s own models/ was imported')\n",
    "script.py": "import zoo\nprint(zoo.list_models())\n",
}


def test_zoo_works_from_a_project_with_its_own_data_train_and_models(installed, tmp_path):
    """Both the CLI and `import zoo`, from a folder whose own modules have the names that a
    top-level `data`, `train` or `models` would have had."""
    for name, text in USER_PROJECT.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{installed}"}
    script = run([sys.executable, "script.py"], cwd=tmp_path, **env)
    assert script.returncode == 0, script.stderr
    assert "'xor'" in script.stdout and "'gpt'" in script.stdout
    cli = run(
        [
            sys.executable,
            "-m",
            "zoo.train",
            "model=xor",
            "trainer.steps=20",
            f"workdir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        **env,
    )
    assert cli.returncode == 0, cli.stderr
    assert "Final eval @ step 20" in cli.stderr
    imported = run(
        [sys.executable, "-c", "import zoo.engine.loop.trainer, zoo; print(zoo.__file__)"],
        cwd=tmp_path,
        **env,
    )
    assert imported.stdout.strip() == str(installed / "zoo" / "__init__.py"), imported.stderr


def project_modules(site: Path) -> list[str]:
    """Every module of the installed package, found on disk (not by importing it)."""
    modules = []
    for path in sorted((site / "zoo").rglob("*.py")):
        parts = path.relative_to(site).with_suffix("").parts
        modules.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return modules


# The parent loads the third-party libraries once, then forks one child per module: each child
# starts with no module of this project loaded and imports one of them first. A fresh
# interpreter per module would do the same at two seconds of library imports each.
FIRST_IMPORTS = """
import importlib, os, sys
for library in {third_party!r}:
    importlib.import_module(library)
assert not any(name.split(".")[0] == "zoo" for name in sys.modules)
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


def test_every_module_imports_on_its_own_first(installed):
    modules = [m for m in project_modules(installed) if not m.endswith("__main__")]
    assert (
        len(modules) > 40 and "zoo.engine.loop.trainer" in modules and "zoo.models.gpt" in modules
    )
    script = FIRST_IMPORTS.format(third_party=THIRD_PARTY, modules=modules)
    result = run([sys.executable, "-c", script], cwd=installed, PYTHONPATH=str(installed))
    assert result.returncode == 0, result.stdout + result.stderr


def test_import_contracts_hold(installed):
    """`lint-imports` checks the contracts in pyproject.toml on the installed layout: the layers
    front > models | data > plugin > engine, the built-in plugins importing the engine only
    through `zoo.plugin`, and no cycles between the modules of any package."""
    lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    result = run(
        [lint, "--config", str(ROOT / "pyproject.toml")], cwd=installed, PYTHONPATH=str(installed)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 4 kept, 0 broken." in result.stdout


REFUSED_COMMAND = """
import runpy, sys
sys.argv = ["zoo.train", "model=no_such_model"]
try:
    runpy.run_module("zoo.train", run_name="__main__")
except SystemExit as e:
    print("exit", e.code)
print(sorted({"grain", "orbax.checkpoint", "pyarrow"} & set(sys.modules)))
"""


def test_a_refused_command_line_imports_neither_grain_orbax_nor_pyarrow(installed):
    """They load where a run makes batches, opens checkpoints or reads Parquet: `import zoo`
    and a command line refused by name do without them (about 0.2 CPU-seconds less)."""
    result = run([sys.executable, "-c", REFUSED_COMMAND], cwd=installed, PYTHONPATH=str(installed))
    assert result.returncode == 0, result.stderr
    assert "no_such_model" in result.stdout + result.stderr
    assert result.stdout.strip().splitlines()[-2:] == ["exit 2", "[]"], result.stdout

"""The examples of the README and of every docs page, executed so they cannot go stale.

Each page's ```python blocks run in order as one script, in a fresh directory of its own, as a
user would run them from a project folder. A page names the files its examples need copied into
that directory in a comment that the rendered page does not show:

    <!-- examples: copy tests/fixtures/pretrained/resnet18-timm to resnet18 -->

Where a printed value or a written file matters and the example does not check it itself (an
`assert` in the block), `CHECKS` below checks it, by page.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import ROOT, run_cli

PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]

DECLARATION = re.compile(r"<!--\s*examples:(.*?)-->", flags=re.DOTALL)
COPY = re.compile(r"copy (\S+) to (\S+)")


def read(page: str) -> str:
    return (ROOT / page).read_text()


def code_blocks(text: str, language: str) -> list[str]:
    """The fenced blocks of `language` ("" for none), each dedented by its fence's indent."""
    fence = re.compile(rf"^( *)```{language}\n(.*?)^\1```$", flags=re.DOTALL | re.MULTILINE)
    return [re.sub(rf"(?m)^{indent}", "", body) for indent, body in fence.findall(text)]


def copies(page: str) -> list[tuple[str, str]]:
    """The (source, destination) pairs that `page`'s examples need; any other declaration of
    the page is refused, so that a misspelt one is not silently ignored."""
    pairs = []
    for declaration in DECLARATION.findall(read(page)):
        match = COPY.fullmatch(declaration.strip())
        assert match, f"{page}: cannot read <!-- examples:{declaration}-->; write 'copy SRC to DST'"
        pairs.append(match.groups())
    return pairs


def check_readme(printed: list[str], work: Path) -> None:
    accuracies = [float(a) for a in printed[0].split()]  # your own images, in three formats
    assert len(accuracies) == 3 and min(accuracies) >= 0.7  # chance: 1/3
    assert (work / "runs" / "readme-shards" / "images-00000-of-00001.array_record").is_file()
    printed = printed[1:]
    listed = re.search(r"print\(zoo\.list_models\(\)\)  # (.+)", read("README.md")).group(1)
    assert printed[0] == listed and printed[1] == "(2, 16)"
    assert printed[3].startswith("'")  # the gpt sample, printed as a Python string
    assert float(printed[4]) >= 0.9  # the user model's eval accuracy
    assert (work / "runs" / "readme-mlp" / "checkpoints" / "300").is_dir()
    assert printed[5] == "True"  # trainer.debug ran the steps on concrete arrays
    assert printed[6] == "200 200 300"  # the second run resumed from the first's checkpoint
    assert printed[7] == "fashion_mnist 150"  # the loaded model and its config
    assert float(printed[9]) >= 0.5  # the fine-tuned model on the user's digits (chance: 0.1)
    assert (work / "runs" / "readme-digits" / "checkpoints" / "150").is_dir()
    assert printed[10] == "[0]"  # a blue photo, read as the fine-tuned ResNet reads it
    assert float(printed[11]) >= 0.8  # the held-out photos (chance: 1/3)
    log = (work / "runs" / "readme-resnet" / "train.log").read_text()
    assert "data.normalize=none: model 'resnet' normalises its inputs itself" in log
    assert len(printed) == 12


CHECKS: dict[str, Callable[[list[str], Path], None]] = {"README.md": check_readme}
"""Page -> check(printed lines, the directory the examples ran in)."""


def test_every_check_is_of_a_page_with_examples():
    assert {page for page in CHECKS if code_blocks(read(page), "python")} == set(CHECKS)


@pytest.mark.parametrize("page", [page for page in PAGES if code_blocks(read(page), "python")])
def test_python_examples_run(page, tmp_path):
    for source, destination in copies(page):
        shutil.copytree(ROOT / source, tmp_path / destination)
    script = tmp_path / "examples.py"
    script.write_text("\n\n".join(code_blocks(read(page), "python")))
    # The examples run as on a user's CPU machine, on one device: meshes have their own tests,
    # and several trainings in one process on 8 simulated devices sharing 2 cores is where
    # XLA:CPU's all-reduce rendezvous has (rarely) lost a participant.
    result = subprocess.run(
        [sys.executable, script.name],
        cwd=tmp_path,
        env={**os.environ, "JAX_NUM_CPU_DEVICES": "1"},
        check=False,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert result.returncode == 0, f"{page}'s examples, as one script:\n{result.stderr}"
    CHECKS.get(page, lambda printed, work: None)(result.stdout.splitlines(), tmp_path)


def test_the_first_block_is_the_two_commands_and_ci_runs_the_test_one():
    first_block = code_blocks(read("README.md"), "")[0].strip().splitlines()
    assert len(first_block) == 2
    train_command, test_command = first_block
    assert train_command.endswith("python -m zoo.train model=xor")
    assert test_command.endswith("uv run pytest")
    ci_script = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci_script


ERROR_EXAMPLES = [
    (page, args, expected)
    for page in PAGES
    for args, expected in re.findall(
        r"^\$ python -m zoo\.train (.+)\n(error: .+)$", read(page), flags=re.MULTILINE
    )
]


def test_there_are_error_examples():
    assert ERROR_EXAMPLES


@pytest.mark.parametrize(
    "page, args, expected", ERROR_EXAMPLES, ids=[f"{p}:{a}" for p, a, _ in ERROR_EXAMPLES]
)
def test_error_examples_match_real_output(page, args, expected):
    result = run_cli(*args.split())
    assert result.returncode == 2
    assert result.stderr.strip() == expected

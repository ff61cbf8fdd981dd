"""The examples of the README and of every docs page, executed so they cannot go stale.

Each page's ```python blocks run in order as one script, in a fresh directory of its own, as a
user would run them from a project folder. A page names the files its examples need copied into
that directory in a comment that the rendered page does not show:

    <!-- examples: copy tests/fixtures/pretrained/resnet18-timm to resnet18 -->

A Python block titled with a file name (```python title="my_models.py"```) is that file, which
the page's script imports: it is written into the directory before the script runs, and is not
part of it.

An example checks what it shows itself, with `assert`: what it prints is for the reader.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest
from helpers import ROOT, run_cli

PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]

DECLARATION = re.compile(r"<!--\s*examples:(.*?)-->", flags=re.DOTALL)
COPY = re.compile(r"copy (\S+) to (\S+)")


def read(page: str) -> str:
    return (ROOT / page).read_text()


PYTHON = re.compile(r"(?:python|py)3?\b.*")
"""The info string of a Python block, attributes included (```python title="my_models.py")."""
TITLE = re.compile(r'\btitle="([^"]+)"')


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of each fenced block of a Markdown text, in order; the body dedented
    by its fence's indent (a block inside a list item)."""
    blocks, opening = [], None
    for line in text.splitlines(keepends=True):
        fence = re.match(r"( *)```(.*)$", line.rstrip("\n"))
        if opening is None and fence:
            opening, body = fence, []
        elif opening is not None and fence and fence.groups() == (opening.group(1), ""):
            blocks.append((opening.group(2).strip(), "".join(body)))
            opening = None
        elif opening is not None:
            body.append(line.removeprefix(opening.group(1)))
    return blocks


def python_blocks(text: str) -> list[str]:
    """The page's script: its Python blocks but those that are files."""
    return [
        body
        for info, body in code_blocks(text)
        if PYTHON.fullmatch(info) and not TITLE.search(info)
    ]


def python_files(text: str) -> list[tuple[str, str]]:
    """(file name, body) of each Python block titled with a file name."""
    return [
        (title.group(1), body)
        for info, body in code_blocks(text)
        if PYTHON.fullmatch(info) and (title := TITLE.search(info))
    ]


def copies(page: str) -> list[tuple[str, str]]:
    """The (source, destination) pairs that `page`'s examples need; any other declaration of
    the page is refused, so that a misspelt one is not silently ignored."""
    pairs = []
    for declaration in DECLARATION.findall(read(page)):
        match = COPY.fullmatch(declaration.strip())
        assert match, f"{page}: cannot read <!-- examples:{declaration}-->; write 'copy SRC to DST'"
        pairs.append(match.groups())
    return pairs


@pytest.mark.parametrize("page", [page for page in PAGES if python_blocks(read(page))])
def test_python_examples_run(page, tmp_path):
    for source, destination in copies(page):
        shutil.copytree(ROOT / source, tmp_path / destination)
    for name, body in python_files(read(page)):
        (tmp_path / name).write_text(body)
    script = tmp_path / "examples.py"
    script.write_text("\n\n".join(python_blocks(read(page))))
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
    # The end of what it wrote: the traceback, after the log lines of the runs before it.
    assert result.returncode == 0, f"{page}'s examples ({script}):\n...{result.stderr[-3000:]}"


def test_the_first_block_is_the_two_commands_and_ci_runs_the_test_one():
    info, first_block = code_blocks(read("README.md"))[0]
    assert info == ""
    first_block = first_block.strip().splitlines()
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

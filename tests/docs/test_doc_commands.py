"""Every program that the README and the docs pages tell a reader to run exists where they say.

A shell command of a page (a line of a fenced block without a language or marked `bash`, `sh`,
`shell` or `console`; in a block with `$ ` prompts, the prompted lines only) names programs: the
first word of each command of a `&&`, `||`, `|` or `;` chain, after `VAR=value` prefixes and
`sudo`/`env`/`time`, and the command that `uv run` or `python -m uv run` runs. Each must be one
that the reader has:

- a console script of the project's environment (the one running these tests: its `bin/`, and
  the entry points of every package installed in it, which are the locked dependencies and the
  extras the tests need);
- a program of a fresh machine, in `SYSTEM` (a short list);
- or one the same page installs first: `pip install`, `pipx install`, `uv tool install`, `uv run
  --extra`, `uv sync --extra`, `apt-get install` (`pip install vllm`, then `vllm serve ...`);
  what the setup pages (`SETUP_PAGES`) install, uv above all, every page may run.

`python -m MODULE` must name a module the environment has or the page installs. Output shown
beside a command goes in a ```` ```text ```` block, which is not read.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest
from helpers import ROOT
from test_doc_examples import PAGES, code_blocks, read

SHELL_BLOCKS = {"", "bash", "sh", "shell", "console"}
SYSTEM = {
    # the shell's own, and the shells
    *("cd", "export", "source", ".", "echo", "set", "unset", "exit", "kill", "sleep"),
    *("bash", "sh"),
    # a fresh Debian or Ubuntu machine's
    *("ls", "cat", "cp", "mv", "rm", "mkdir", "tar", "head", "tail", "grep", "tee", "git"),
    *("sudo", "env", "apt-get", "apt", "curl", "nproc"),
    # a GPU machine's, with its driver
    "nvidia-smi",
    # Python 3.11+ with pip, which the README assumes (the programs, and `python3 -m pip`)
    *("pip", "pip3"),
}
PYTHON = re.compile(r"python(3(\.\d+)?)?")
SEPARATORS = {"&&", "||", "|", ";", "&", "(", ")", "|&"}
WRAPPERS = {"sudo", "env", "time", "nohup", "exec"}
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
# Options of `pip install`, `uv run` and `apt-get install` whose value is the next word.
VALUED = {
    *("-r", "-c", "-i", "-t", "-f", "--index-url", "--extra-index-url", "--find-links"),
    *("--target", "--python", "-p", "--with", "--group", "--directory", "--project"),
    *("--env-file", "--index", "-o", "--module"),
}
INSTALLERS = [
    *(("pip", "install"), ("pip3", "install"), ("pipx", "install")),
    *(("uv", "pip", "install"), ("uv", "tool", "install"), ("uv", "add")),
    *(("apt-get", "install"), ("apt", "install")),
]


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def environment_programs() -> set[str]:
    """The console scripts of the environment running the tests."""
    bin_dir = Path(sys.prefix) / "bin"
    names = {p.name for p in bin_dir.iterdir()} if bin_dir.is_dir() else set()
    for group in ("console_scripts", "gui_scripts"):
        names |= {entry.name for entry in importlib.metadata.entry_points(group=group)}
    return names


def package_programs(requirement: str) -> set[str]:
    """The programs (and module names) a package gives once installed: its name, and its
    console scripts where its metadata is at hand."""
    name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    if name is None:
        return set()
    name = name.group()
    given = {name, normalized(name), normalized(name).replace("-", "_")}
    try:
        entry_points = importlib.metadata.distribution(name).entry_points
    except importlib.metadata.PackageNotFoundError:
        return given
    return given | {e.name for e in entry_points if e.group in ("console_scripts", "gui_scripts")}


def extra_programs(extras: list[str]) -> set[str]:
    """What the project's extras (`pip install '.[bench]'`, `uv run --extra bench`) install."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        optional = tomllib.load(f)["project"]["optional-dependencies"]
    programs = set()
    for extra in extras:
        for requirement in optional.get(extra, []):
            inner = re.fullmatch(r"zoo\[(.*)\]", requirement)
            programs |= (
                extra_programs(inner.group(1).split(","))
                if inner
                else package_programs(requirement)
            )
    return programs


def logical_lines(body: str) -> list[str]:
    """A shell block's commands: the `$ ` prompted lines where the block has any (the rest is
    their output), else every line; `\\`-continued lines joined; here-documents left out."""
    lines = body.splitlines()
    prompted = any(line.startswith("$ ") for line in lines)
    commands, pending, heredoc = [], "", None
    for line in lines:
        if heredoc is not None:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        if not pending and prompted:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        pending += line
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending.strip():
            commands.append(pending.strip())
            opening = re.search(r"<<-?\s*['\"]?(\w+)", pending)
            heredoc = opening.group(1) if opening else None
        pending = ""
    return commands


def shell_commands(text: str) -> list[str]:
    """The command lines of a Markdown text's shell blocks, in order."""
    return [
        line
        for info, body in code_blocks(text)
        if info.split(" ")[0] in SHELL_BLOCKS
        for line in logical_lines(body)
    ]


def uncommented(line: str) -> str:
    """`line` up to its comment: a `#` that starts a word outside quotes, as the shell reads
    it (`hf://ORG/NAME#x` is no comment, `# it's` is)."""
    quote = None
    for i, char in enumerate(line):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def simple_commands(line: str) -> list[list[str]]:
    """A command line's simple commands, each as its words, without comments and
    redirections."""
    lexer = shlex.shlex(uncommented(line), posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, ""
    commands, words, redirected = [], [], False
    for token in lexer:
        if token in SEPARATORS:
            commands.append(words)
            words = []
        elif token[0] in "<>" or token == ">&":
            redirected = True
            if words and words[-1].isdigit():  # the 2 of 2>&1
                words.pop()
        elif redirected:
            redirected = False
        else:
            words.append(token)
    return [c for c in [*commands, words] if c]


def unwrapped(words: list[str]) -> list[str]:
    """A command's words from the program it runs: past `VAR=value` prefixes and
    `sudo`/`env`/`time`."""
    while words and (ASSIGNMENT.match(words[0]) or words[0] in WRAPPERS):
        words = words[1:]
        while words and words[0].startswith("-"):  # the wrapper's own options
            words = words[1:]
    return words


def options_skipped(words: list[str]) -> tuple[list[str], list[str]]:
    """(the words after the leading options, the values of the `--extra` options)."""
    extras = []
    while words and words[0].startswith("-"):
        option, words = words[0], words[1:]
        if option == "--extra" and words:
            extras.append(words[0])
        if option in VALUED | {"--extra"} and words:
            words = words[1:]
    return words, extras


def invocations(words: list[str]) -> list[tuple[str, str, list[str]]]:
    """What a simple command runs, as (kind, name, its arguments): kind "program" or "module"
    (`python -m NAME`), or "extras" (`uv run` and `uv sync`'s `--extra`, names joined by
    commas); `uv run` and `python -m uv run` give what they run too."""
    words = unwrapped(words)
    if not words:
        return []
    program, rest = words[0], words[1:]
    found = [("program", program, rest)]
    if PYTHON.fullmatch(Path(program).name) and rest[:1] == ["-m"] and len(rest) > 1:
        found.append(("module", rest[1], rest[2:]))
        program, rest = rest[1], rest[2:]
    if Path(program).name == "uv" and rest[:1] in (["run"], ["sync"]):
        inner, extras = options_skipped(rest[1:])
        found.append(("extras", ",".join(extras), []))
        if rest[0] == "run":
            found += invocations(inner)
    return found


def installed_by(words: list[str]) -> set[str]:
    """The programs and modules an install command (`pip install X`, `python -m pip install X`,
    `apt-get install X`, `uv run --extra X`, ...) makes available."""
    given = set()
    for kind, name, args in invocations(words):
        if kind == "extras":
            given |= extra_programs([e for e in name.split(",") if e])
            continue
        command = [Path(name).name, *args] if kind == "program" else [name, *args]
        for installer in INSTALLERS:
            if tuple(command[: len(installer)]) != installer:
                continue
            remaining = command[len(installer) :]
            while remaining:
                targets, _ = options_skipped(remaining)
                if not targets:
                    break
                target, remaining = targets[0], targets[1:]
                local = re.fullmatch(r"[./][^\[]*(?:\[(.*)\])?", target)
                if local:
                    given |= extra_programs((local.group(1) or "").split(","))
                elif installer[0].startswith("apt"):
                    given.add(target)
                else:
                    given |= package_programs(target)
    return given


def module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package
        return False


def missing_programs(commands: list[str], available: set[str]) -> list[str]:
    """`command: program` for each program or module of `commands` that is neither in
    `available`, nor a system program, nor installed by an earlier command of the list."""
    available, missing = set(available), []
    for line in commands:
        try:
            words_of_line = simple_commands(line)
        except ValueError as error:  # an unclosed quote
            missing.append(f"{line}: not a shell command ({error})")
            continue
        for words in words_of_line:
            for kind, name, _ in invocations(words):
                if kind == "program":
                    known = (
                        name in SYSTEM
                        or Path(name).name in available | SYSTEM
                        or PYTHON.fullmatch(Path(name).name)
                        or ("/" in name and (ROOT / name).is_file())
                    )
                elif kind == "module":
                    known = name.split(".")[0] in available | SYSTEM or module_exists(name)
                else:
                    continue
                if not known:
                    missing.append(f"{line}: {kind} {name!r}")
                    break  # the first that is missing: a line of output names every word
            available |= installed_by(words)
    return missing


PAGE_COMMANDS = {page: shell_commands(read(page)) for page in PAGES}


SETUP_PAGES = ["README.md", "docs/install.md", "docs/getting-started.md"]
"""The pages that set the environment up: what their install commands install (uv) every page
may run."""


@pytest.fixture(scope="module")
def available() -> set[str]:
    installed = environment_programs()
    for page in SETUP_PAGES:
        for line in PAGE_COMMANDS.get(page, []):
            with contextlib.suppress(ValueError):  # not a command: its page's test says so
                for words in simple_commands(line):
                    installed |= installed_by(words)
    return installed


@pytest.mark.parametrize("page", [page for page, commands in PAGE_COMMANDS.items() if commands])
def test_every_program_a_page_runs_is_installed(page, available):
    missing = missing_programs(PAGE_COMMANDS[page], available)
    assert not missing, (
        f"{page} runs programs that neither the project's environment ({sys.prefix}), nor a "
        "fresh machine, nor an install command before them on the page provides (output "
        "shown beside a command goes in a ```text block):\n" + "\n".join(missing)
    )


def test_the_environment_has_the_programs_the_docs_name(available):
    assert {"hf", "tensorboard", "mkdocs", "pytest"} <= available


@pytest.mark.parametrize(
    "block, missing",
    [
        # huggingface-hub 2.x installs `hf` alone
        ("huggingface-cli download gpt2 --local-dir gpt2", ["huggingface-cli"]),
        ("hf download gpt2 --local-dir gpt2   # huggingface-cli's successor", []),
        ("$ python -m zoo.train model=xor\nerror: model.num_hidden=0 must be at least 1", []),
        ("ZOO_PLUGINS=my_models python -m zoo.train model=relu_mlp", []),
        ("python -m zoo.train model=xor && vllm serve Qwen/Qwen3-0.6B | tee log", ["vllm"]),
        ("pip install vllm   # an environment of its own\nvllm serve Qwen/Qwen3-0.6B", []),
        ("sudo apt-get install -y chromium && chromium --headless=new x.html", []),
        ("python3 -m pip install uv && python3 -m uv run tensorboard --logdir runs", []),
        ("python3 -m uv run --extra bench torchrun x.py", ["torchrun"]),
        ("python3 -m uv sync --extra bench && python3 -m uv run python -m torch.utils", []),
        ("python3 -m uv run some-tool --logdir runs", ["some-tool"]),
        ("python -m zoo.trian model=xor", ["zoo.trian"]),
        ("pip install vllm\npython -m vllm.entrypoints.openai.api_server", []),
        ("python3 -m venv ~/uv && ~/uv/bin/pip install uv\n~/uv/bin/uv run x", ["x"]),
        ("(cd zoo && git pull) 2>&1 >log.txt; make", ["make"]),
        ("cat <<EOF > a.txt\nhello there\nEOF\nls", []),
    ],
)
def test_a_command_whose_program_nothing_installs_is_named(block, missing, available):
    found = missing_programs(shell_commands(f"```\n{block}\n```\n"), available)
    assert [entry.rsplit(" ", 1)[-1].strip("'") for entry in found] == missing, found

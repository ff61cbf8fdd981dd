"""Writes docs/reference/config.md: every key of a run's config, from the typed schema.

    python docs/make_config_reference.py           # rewrite the page
    python docs/make_config_reference.py --check   # exit 1 if the page is not what it writes

The sections are `zoo.engine.config.Config`'s dataclasses; the `model.*` and `data.*` keys are
each registered model's and data set's config schema (their constructor's or loader's keyword
parameters). A key's documentation is the comment that the schema's source has for it: the
comment lines right above the field or parameter, and the comment at the end of its line (a
parameter typed as a dataclass of options stands for its fields, documented so). Every
key must have one: either command refuses, naming each key without one and where it is declared.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import io
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from zoo.engine import registry
from zoo.engine.config import Config

from zoo.hydra_store import DEFAULT_MODEL

PAGE = Path(__file__).resolve().parent / "reference" / "config.md"
COMMAND = "python docs/make_config_reference.py"
HEADER = "| key | type | default | meaning |"
TOP_LEVEL = "The top level"

INTRO = f"""\
# Config keys

<!-- Written by `{COMMAND}` from the config schema: edit the comments
of the schema's source (zoo.engine.config, a model's constructor, a data set's loader), then run
it again. -->

Every key of a run's config, with its type and default. Set any of them on the command line
(`python -m zoo.train model=cnn trainer.steps=500`) or from Python (`zoo.fit("cnn",
"trainer.steps=500")`, `zoo.compose([...])`); `python -m zoo.train model=NAME --cfg job` prints
the whole resolved config of a run. A model may set defaults of its own for the `trainer`,
`optimizer` and `data` keys: they are listed with the model. A fine-tune of a pretrained
checkpoint takes `optimizer` defaults of its kind (LoRA, full) in place of the model's:
[Fine-tuning defaults](../fine-tuning.md#fine-tuning-defaults).
"""


def key_docs(obj: type | Callable[..., Any]) -> dict[str, str]:
    """The comment the source gives each field of the dataclass `obj`, or each parameter of the
    function `obj`: the comment lines right above it, then the one at the end of its line."""
    source = textwrap.dedent(inspect.getsource(obj))
    lines = source.splitlines()
    comments = {
        token.start[0]: token.string.lstrip("#").strip()
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT and not token.string.lstrip("# ").startswith("noqa")
    }

    def own_line(number: int) -> bool:
        return lines[number - 1].lstrip().startswith("#")

    docs = {}
    for name, first, last in _named_lines(ast.parse(source).body[0]):
        above, number = [], first - 1
        while number in comments and own_line(number):
            above.insert(0, comments[number])
            number -= 1
        at_end = [comments[n] for n in range(first, last + 1) if n in comments and not own_line(n)]
        docs[name] = " ".join(above + at_end)
    return docs


def _named_lines(node: ast.AST) -> Iterator[tuple[str, int, int]]:
    """(name, first line, last line) of each field of a class or parameter of a function."""
    if isinstance(node, ast.ClassDef):
        for statement in node.body:
            if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
                yield statement.target.id, statement.lineno, statement.end_lineno
    else:
        arguments = node.args
        for argument in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]:
            yield argument.arg, argument.lineno, argument.end_lineno


def type_text(hint: Any) -> str:
    """A key's type as a user writes its values."""
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(f"`{member.value}`" for member in hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = [type_text(arg) for arg in typing.get_args(hint) if arg is not type(None)]
        nullable = type(None) in typing.get_args(hint)
        return " or ".join(options) + (" or `null`" if nullable else "")
    if typing.get_origin(hint) is list:
        return f"`list[{typing.get_args(hint)[0].__name__}]`"
    if typing.get_origin(hint) is dict:
        return "`dict`"
    if hint is Any:
        return "any"
    return f"`{hint.__name__}`"


def value_text(value: Any) -> str:
    """A default as it is written on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(value_text(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {value_text(item)}" for key, item in value.items()) + "}"
    return str(value) if value != "" else "''"


def default_of(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return field.default


def key_table(prefix: str, schema: type, docs: dict[str, str], omit=()) -> list[str]:
    """A table of the keys of `schema`: its fields but those in `omit` and nested sections."""
    hints = typing.get_type_hints(schema)
    rows = [HEADER, "|---|---|---|---|"]
    for field in dataclasses.fields(schema):
        if field.name in omit or dataclasses.is_dataclass(hints[field.name]):
            continue
        doc = docs.get(field.name, "").replace("|", "\\|")
        default = value_text(default_of(field)).replace("|", "\\|")
        rows.append(
            f"| `{prefix}{field.name}` | {type_text(hints[field.name])} | `{default}` | {doc} |"
        )
    return rows


def run_sections(schema: type, prefix: str = "") -> Iterator[list[str]]:
    """The sections of the run config: one per dataclass, nested ones after their parent."""
    hints = typing.get_type_hints(schema)
    for field in dataclasses.fields(schema):
        section = hints[field.name]
        if dataclasses.is_dataclass(section):
            name = f"{prefix}{field.name}"
            yield [f"## `{name}`", "", *key_table(f"{name}.", section, key_docs(section))]
            yield from run_sections(section, f"{name}.")


def top_level() -> list[str]:
    """The choices of model and data set, then the other top-level keys."""
    models = ", ".join(f"`{name}`" for name in registry.list_models())
    datasets = ", ".join(f"`{name}`" for name in registry.list_datasets())
    rows = [
        f"| `model` | one of {models} | `{DEFAULT_MODEL}` | the model to train: its keys are below |",
        f"| `data` | one of {datasets} | the model's | the data set: its keys are below |",
    ]
    table = key_table("", Config, key_docs(Config), omit=("model", "data"))
    return [f"## {TOP_LEVEL}", "", *table[:2], *rows, *table[2:]]


def first_paragraph(text: str | None) -> str:
    return " ".join((text or "").strip().split("\n\n")[0].split())


def model_section(name: str) -> list[str]:
    entry = registry.get_model(name)
    constructor = entry.constructor
    target = constructor.__init__ if inspect.isclass(constructor) else constructor
    own = (
        constructor.__dict__.get("__doc__") if inspect.isclass(constructor) else constructor.__doc__
    )
    what = first_paragraph(own or sys.modules[constructor.__module__].__doc__)
    docs = parameter_docs(target)
    defaults = [f"data={entry.default_data}"] + [
        f"{section}.{key}={value_text(value)}"
        for section in ("trainer", "optimizer", "data")
        for key, value in getattr(entry, section).items()
    ]
    lines = [f"### `model={name}`", "", what, ""]
    lines += [f"Defaults it sets: {', '.join(f'`{d}`' for d in defaults)}.", ""]
    return lines + key_table("model.", entry.config, docs, omit=("name",))


def data_section(name: str) -> list[str]:
    entry = registry.get_data(name)
    lines = [f"### `data={name}`", ""]
    if entry.load.__doc__:
        lines += [" ".join(inspect.getdoc(entry.load).split()), ""]
    if entry.info:
        facts = ", ".join(f"`{key}` {value_text(value)}" for key, value in entry.info.items())
        lines += [f"It tells models: {facts}.", ""]
    return lines + key_table("data.", entry.config, parameter_docs(entry.load), omit=("name",))


def parameter_docs(fn: Callable[..., Any]) -> dict[str, str]:
    """The comments of `fn`'s parameters; a parameter typed as a dataclass of options (a data
    set loader's `options: ImageOptions`, a model's `options: DecoderOptions`) stands for its
    fields, the config keys, documented by theirs."""
    docs = key_docs(fn)
    for name, hint in typing.get_type_hints(inspect.unwrap(fn)).items():
        if name != "return" and dataclasses.is_dataclass(hint):
            docs |= key_docs(hint)
    return docs


def render() -> str:
    sections = [INTRO.splitlines(), top_level(), *run_sections(Config)]
    sections.append(["## `model`: the keys of each model"])
    sections += [model_section(name) for name in registry.list_models()]
    sections.append(["## `data`: the keys of each data set"])
    sections += [data_section(name) for name in registry.list_datasets()]
    return "\n\n".join("\n".join(section).strip() for section in sections) + "\n"


def keys_without_meaning(page: str) -> list[str]:
    """Each key whose row on `page` has an empty meaning, with where it is declared."""
    missing, heading = [], ""
    for line in page.splitlines():
        if line.startswith("#"):
            heading = line.lstrip("# ").strip("`")
        elif line.startswith("| `") and line.endswith("|  |"):
            key = line.split("`")[1]
            missing.append(f"{key} ({declared_in(heading)})")
    return missing


def declared_in(heading: str) -> str:
    """Where the keys under `heading` are declared: a model's constructor, a data set's loader
    or the run config's dataclasses."""
    kind, _, name = heading.partition("=")
    if kind == "model":
        source = registry.get_model(name).constructor
    elif kind == "data":
        source = registry.get_data(name).load
    else:
        source = Config
        for section in heading.split(".") if heading != TOP_LEVEL else []:
            source = typing.get_type_hints(source)[section]
    return f"{source.__qualname__} in {inspect.getsourcefile(source)}"


def main(argv: list[str]) -> int:
    if argv not in ([], ["--check"]):
        print(__doc__)
        return 2
    page = render()
    missing = keys_without_meaning(page)
    if missing:
        print(
            f"These config keys have no meaning for {PAGE}: {'; '.join(missing)}. Write each "
            "one's meaning as a comment above or beside its field or parameter, then run "
            f"`{COMMAND}`."
        )
        return 1
    if argv == ["--check"]:
        if PAGE.read_text() != page:
            print(f"{PAGE} is not what the config schema gives: run `{COMMAND}`.")
            return 1
        return 0
    PAGE.write_text(page)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

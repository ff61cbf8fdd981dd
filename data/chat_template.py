"""Chat templates: the text a chat checkpoint's model reads for a conversation.

A checkpoint's template is its `chat_template.jinja` (the file transformers 5 writes), else the
`chat_template` entry of its `tokenizer_config.json` (older checkpoints: a string, or a list of
`{name, template}` of which the one named `default` is used). It is rendered as transformers'
`apply_chat_template` renders it, so that a model reads the text it was trained on, byte for
byte: Jinja's `ImmutableSandboxedEnvironment` with `trim_blocks` and `lstrip_blocks`, the
`loopcontrols` extension, `raise_exception(message)`, `strftime_now(format)`, a `tojson` that
keeps non-ASCII text and takes `indent`, `separators` and `sort_keys`, guarded `dict` and
`namespace`; the variables `messages`, `add_generation_prompt`, `tools` and `documents` (None
unless given), the tokenizer's special tokens (`bos_token`, `eos_token`, ... and a model's own
`*_token` entries, as `special_tokens` reads them) and any further keywords (`enable_thinking`,
`date_string`, ...). A message's `None` values are dropped and its reasoning is offered under
`reasoning_content` and `thinking`, as transformers does.

A template is code from whoever published the checkpoint. The sandbox keeps it from Python's
internals and from changing what it is given; on top of that, a template that names a dunder
attribute (`__class__`, `__subclasses__`, `__globals__`, ...) is refused before it runs, and one
that reaches outside the sandbox while running is stopped there: both as a `ZooError` naming
the template's error. What a template is given is plain data (text, numbers, lists, dicts), so
that no method of a caller's object is in its reach.

`{% generation %}...{% endgeneration %}` marks the text a model is trained to write (the
assistant's turns): `render_chat_with_spans` returns the character spans of those parts, as
transformers' `return_assistant_tokens_mask` reads them, for assistant-only loss masks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import meta, nodes
from jinja2.exceptions import SecurityError, TemplateError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from zoo.data.text import load_tokenizer

from zoo.plugin import ZooError

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
GENERATION_CONFIG = "generation_config.json"
STANDARD_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""The named special tokens every tokenizer has (transformers' `SPECIAL_TOKENS_ATTRIBUTES`)."""
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
"""The names a message's reasoning comes under; templates read the first (gpt-oss: `thinking`)."""
VALID_MESSAGE = (
    "a message is a dict with a 'role' (text such as 'system', 'user' or 'assistant') and a "
    "'content': text, a list of dicts such as {'type': 'text', 'text': ...}, or a dict (a "
    "tool's result); an assistant message with 'tool_calls' may leave the content out"
)

Span = tuple[int, int]
"""Character offsets `[start, end)` into the rendered text."""


def read_chat_template(directory: str | os.PathLike) -> str | None:
    """The chat template of the checkpoint in `directory`: its `chat_template.jinja`, else its
    `tokenizer_config.json`'s `chat_template` entry; None when it has neither."""
    directory = Path(directory)
    if (directory / TEMPLATE_FILE).is_file():
        return (directory / TEMPLATE_FILE).read_text(encoding="utf-8")
    config = directory / TOKENIZER_CONFIG
    entry = _read_json(config).get("chat_template")
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, list) and all(
        isinstance(item, dict) and isinstance(item.get("template"), str) for item in entry
    ):
        named = {item.get("name"): item["template"] for item in entry}
        if "default" in named:
            return named["default"]
        raise ZooError(
            f"The chat templates of {config} are named {sorted(map(str, named))}, none of them "
            "'default': zoo renders the default one; name one of them 'default'."
        )
    raise ZooError(
        f"The chat_template entry of {config} is neither text nor a list of "
        f"{{'name': ..., 'template': ...}}: {entry!r:.200}."
    )


def special_tokens(directory: str | os.PathLike) -> dict[str, str]:
    """The special tokens a template sees as variables, as transformers' `special_tokens_map`
    has them: the named ones of `tokenizer_config.json` (`bos_token`, `eos_token`, ...), a
    model's own `*_token` entries and `extra_special_tokens` given as a dict (Gemma 3's
    `boi_token`, ...), and those of a legacy `special_tokens_map.json`."""
    directory = Path(directory)
    config = _read_json(directory / TOKENIZER_CONFIG)
    if "added_tokens_decoder" not in config:
        config = {**config, **_read_json(directory / SPECIAL_TOKENS_MAP)}
    tokens = {name: config[name] for name in STANDARD_TOKENS if name in config}
    tokens |= {
        name: value
        for name, value in config.items()
        if name.endswith("_token") and name not in STANDARD_TOKENS and isinstance(value, str)
    }
    if isinstance(config.get("extra_special_tokens"), dict):
        tokens |= config["extra_special_tokens"]
    return {name: _token_text(value) for name, value in tokens.items() if value is not None}


def end_of_turn_ids(directory: str | os.PathLike) -> tuple[int, ...]:
    """The token ids that end an assistant's turn for the checkpoint in `directory`:
    `generation_config.json`'s `eos_token_id` (one id or a list; `config.json`'s when there is
    no generation config), then the id of `tokenizer_config.json`'s `eos_token`. An instruct
    checkpoint lists its end of turn there (`<|im_end|>`, `<|eot_id|>`, `<end_of_turn>`)."""
    directory = Path(directory)
    settings = _read_json(directory / GENERATION_CONFIG) or _read_json(directory / "config.json")
    listed = settings.get("eos_token_id")
    ids = [] if listed is None else list(listed) if isinstance(listed, list) else [listed]
    if not all(isinstance(token, int) and not isinstance(token, bool) for token in ids):
        raise ZooError(
            f"The eos_token_id of {directory} is {listed!r}: give a token id or a list of them."
        )
    eos = special_tokens(directory).get("eos_token")
    if eos is not None:
        ids.append(_token_id(directory, eos))
    return tuple(dict.fromkeys(ids))


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    **extra,
) -> str:
    """The text `template` renders for `messages`, with the opening of the assistant's next
    turn when `add_generation_prompt`; `extra` are the template's further variables (the
    special tokens, `tools`, `documents`, `enable_thinking`, ...)."""
    return _render(template, messages, add_generation_prompt, extra)[0]


def render_chat_with_spans(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = False,
    **extra,
) -> tuple[str, list[Span]]:
    """`render_chat`'s text and the character spans its `{% generation %}` blocks rendered, in
    order (none when the template has no such block: see `has_generation_markers`)."""
    return _render(template, messages, add_generation_prompt, extra, spans=True)


def template_variables(template: str) -> frozenset[str]:
    """The names `template` reads from outside, besides the environment's functions: `messages`,
    `add_generation_prompt`, the special tokens and its further variables (`enable_thinking`,
    `tools`, ...), so that a variable it never reads can be refused by name rather than ignored.
    Jinja cannot tell a name set in one branch and read in another from an outside one: such
    names are among them."""
    return _compiled(template).variables


def has_generation_markers(template: str) -> bool:
    """Whether `template` marks the assistant's parts with `{% generation %}` blocks."""
    return _compiled(template).has_markers


@dataclass(frozen=True)
class ChatTemplate:
    """A checkpoint's chat template with the special tokens it is rendered with."""

    template: str
    tokens: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> ChatTemplate:
        """The chat template of the checkpoint in `directory`; a `ZooError` if it has none."""
        template = read_chat_template(directory)
        if template is None:
            raise ZooError(
                f"{directory} has no chat template: neither a {TEMPLATE_FILE} nor a "
                f"chat_template entry in its {TOKENIZER_CONFIG}. Give messages to a checkpoint "
                "that has one, and a prompt (text) to this one."
            )
        return cls(template, special_tokens(directory))

    def render(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra
    ) -> str:
        """`render_chat` with this checkpoint's special tokens (`extra` overrides them)."""
        variables = {**self.tokens, **extra}
        return render_chat(self.template, messages, add_generation_prompt, **variables)

    def render_with_spans(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False, **extra
    ) -> tuple[str, list[Span]]:
        """`render_chat_with_spans` with this checkpoint's special tokens (`extra` overrides
        them)."""
        variables = {**self.tokens, **extra}
        return render_chat_with_spans(self.template, messages, add_generation_prompt, **variables)


def _render(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
    extra: dict[str, Any],
    spans: bool = False,
) -> tuple[str, list[Span]]:
    compiled = _compiled(template)
    variables = {
        name: _plain(value, name)
        for name, value in {"tools": None, "documents": None, **extra}.items()
    }
    missing = sorted(compiled.tokens - variables.keys())
    if missing:
        raise ZooError(
            f"The chat template reads {', '.join(missing)}, which nothing gives (a checkpoint's "
            f"{TOKENIZER_CONFIG} names its special tokens): give it as a keyword, e.g. "
            "bos_token='<s>', rather than have it rendered as nothing."
        )
    variables["messages"] = _conversation(messages)
    variables["add_generation_prompt"] = add_generation_prompt
    try:
        if not spans:
            return compiled.template.render(variables), []
        with _markers().tracking() as (blocks, marked):
            blocks.extend(compiled.template.generate(variables))
    except SecurityError as e:
        raise ZooError(f"The chat template tried to reach outside its sandbox: {e}") from None
    except _Refusal as e:
        raise ZooError(f"The chat template refused the conversation: {e}") from None
    except Exception as e:  # noqa: BLE001  (the template is foreign code: name whatever it raised)
        raise ZooError(f"The chat template failed: {type(e).__name__}: {e}") from None
    return _checked_spans("".join(blocks), marked)


def _checked_spans(text: str, marked: list[tuple[int, str]]) -> tuple[str, list[Span]]:
    """The spans of the marked parts, each checked to hold its part: a `{% generation %}`
    block inside a macro or a `{% set %}` block is rendered away from where it lands."""
    found = [(start, start + len(part)) for start, part in marked]
    for (start, end), (_, part) in zip(found, marked, strict=True):
        if text[start:end] != part:
            raise ZooError(
                f"The chat template's {{% generation %}} block that rendered {part[:60]!r} "
                "is not where the text holds it (a block inside a macro, a call or a {% set %} "
                "block): move it to the template's top level, as transformers requires."
            )
    return text, found


def _conversation(messages: Any) -> list[dict[str, Any]]:
    """`messages` as the template sees them: plain data, `None` values dropped, the
    reasoning under each of its names; a `ZooError` naming a malformed message."""
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
        raise ZooError(
            f"messages must be a list of messages, not a {type(messages).__name__}: "
            f"{VALID_MESSAGE}."
        )
    if not messages:
        raise ZooError(
            f"messages is empty: a conversation has at least one message; {VALID_MESSAGE}."
        )
    return [_message(message, index) for index, message in enumerate(messages)]


def _message(message: Any, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise ZooError(f"{where} is a {type(message).__name__} ({message!r:.80}): {VALID_MESSAGE}.")
    message = {key: value for key, value in _plain(message, where).items() if value is not None}
    problem = _message_problem(message)
    if problem:
        raise ZooError(f"{where} {problem} ({message!r:.200}): {VALID_MESSAGE}.")
    reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _message_problem(message: dict[str, Any]) -> str | None:
    """What is wrong with a message, or None."""
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role:
        return "has no role" if role is None else f"has the role {role!r}, which is not text"
    if content is None:
        return None if message.get("tool_calls") else "has no content"
    if isinstance(content, str | dict) or (
        isinstance(content, list) and all(isinstance(part, dict) for part in content)
    ):
        return None
    return f"has content of type {type(content).__name__}"


def _plain(value: Any, where: str) -> Any:
    """`value` rebuilt of JSON's types, so that the template reaches no method of a caller's
    object; a `ZooError` naming `where` for anything else."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {
            _plain(key, where): _plain(item, f"{where}[{key!r}]") for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        items = [_plain(item, f"{where}[{index}]") for index, item in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    raise ZooError(
        f"{where} is a {type(value).__name__}: a chat template is given text, numbers, "
        "booleans, None, and lists and dicts of them."
    )


@dataclass(frozen=True)
class _Compiled:
    template: jinja2.Template
    has_markers: bool
    variables: frozenset[str]
    """The names the template reads from outside (`template_variables`)."""

    @property
    def tokens(self) -> frozenset[str]:
        """The special tokens (`*_token` variables) the template reads."""
        return frozenset(n for n in self.variables if n.endswith("_token"))


def _compiled(template: str) -> _Compiled:
    """`template` checked and compiled: a `ZooError` for a syntax error or a template that
    names a dunder attribute (a way out of the sandbox), before any of it runs."""
    if not isinstance(template, str):
        raise ZooError(f"A chat template is text, not a {type(template).__name__}.")
    return _compile(template)


@lru_cache(maxsize=64)
def _compile(template: str) -> _Compiled:
    environment = _environment()
    try:
        tree = environment.parse(template)
    except TemplateSyntaxError as e:
        raise ZooError(f"The chat template does not parse: line {e.lineno}: {e.message}.") from None
    escapes = _escapes(tree)
    if escapes:
        raise ZooError(
            f"The chat template reaches for {escapes}, a way out of its sandbox: refused, "
            "never run. A chat template reads its messages' keys, never Python's internals."
        )
    markers = any(
        isinstance(getattr(n.call, "node", None), nodes.ExtensionAttribute)
        for n in tree.find_all(nodes.CallBlock)
    )
    variables = frozenset(meta.find_undeclared_variables(tree) - environment.globals.keys())
    return _Compiled(environment.from_string(tree), markers, variables)


def _escapes(tree: nodes.Template) -> str | None:
    """The dunder attributes `tree` names (`x.__class__`, `x['__class__']`,
    `x|attr('__class__')`) with their lines, or None."""
    found = set()
    for node in tree.find_all((nodes.Getattr, nodes.Getitem, nodes.Filter)):
        if isinstance(node, nodes.Getattr):
            name = node.attr
        elif isinstance(node, nodes.Getitem):
            name = node.arg.value if isinstance(node.arg, nodes.Const) else None
        else:
            const = node.args[0] if node.name == "attr" and node.args else None
            name = const.value if isinstance(const, nodes.Const) else None
        if isinstance(name, str) and name.startswith("__"):
            found.add((node.lineno, name))
    lines = {line: sorted(name for at, name in found if at == line) for line, _ in found}
    return (
        "; ".join(
            f"{', '.join(map(repr, names))} (line {line})" for line, names in sorted(lines.items())
        )
        or None
    )


class _GenerationMarkers(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body, and while tracking records
    where in the text so far that body starts (transformers' `AssistantTracker`)."""

    tags = frozenset({"generation"})

    def __init__(self, environment: jinja2.Environment):
        super().__init__(environment)
        self._tracking: ContextVar[tuple[list[str], list[tuple[int, str]]] | None] = ContextVar(
            "chat_template_spans", default=None
        )

    def parse(self, parser: Any) -> nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller: Any) -> str:
        part = caller()
        tracking = self._tracking.get()
        if tracking is not None:
            blocks, marked = tracking
            marked.append((sum(map(len, blocks)), part))
        return part

    @contextmanager
    def tracking(self):
        """The list the caller appends the rendered blocks to, and the marked parts."""
        token = self._tracking.set(([], []))
        try:
            yield self._tracking.get()
        finally:
            self._tracking.reset(token)


class _Sandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, in which reaching for an unsafe attribute fails at once
    (Jinja's own hands back an undefined value that renders as nothing)."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        kind = type(obj).__name__
        raise SecurityError(f"access to attribute {attribute!r} of {kind!r} objects is unsafe")


@lru_cache(maxsize=1)
def _environment() -> _Sandbox:
    """The sandbox every template renders in, set up as transformers sets up its own."""
    environment = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationMarkers, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = _tojson
    environment.globals |= {
        "raise_exception": _raise_exception,
        "strftime_now": _strftime_now,
        "dict": _TemplateDict(),
        "namespace": _TemplateNamespace,
    }
    return environment


def _markers() -> _GenerationMarkers:
    """The environment's `{% generation %}` extension, which records the spans."""
    extensions = _environment().extensions.values()
    return next(e for e in extensions if isinstance(e, _GenerationMarkers))


class _Refusal(TemplateError):
    """What a template's `raise_exception(message)` raises."""


def _raise_exception(message: str) -> None:
    raise _Refusal(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """JSON as templates expect it: unescaped HTML characters and non-ASCII text."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)` without the class itself in the template's reach."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's `namespace` that stores no attribute whose name starts with an underscore."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a namespace stores no attribute named {name!r} (a leading _)")


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; empty when there is no such file."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ZooError(f"{path} is not JSON: {e}.") from None
    if not isinstance(value, dict):
        raise ZooError(f"{path} holds a {type(value).__name__}, not a JSON object.")
    return value


def _token_text(value: Any) -> str:
    """A special token's text: a string, or the `content` of an added token's dict."""
    return str(value["content"]) if isinstance(value, dict) and "content" in value else str(value)


def _token_id(directory: Path, token: str) -> int:
    """The id of `token` in the checkpoint's added tokens or its `tokenizer.json`."""
    added = _read_json(directory / TOKENIZER_CONFIG).get("added_tokens_decoder", {})
    for token_id, entry in added.items():
        if isinstance(entry, dict) and entry.get("content") == token:
            return int(token_id)
    found = (
        load_tokenizer(directory).token_to_id(token)
        if (directory / "tokenizer.json").is_file()
        else None
    )
    if found is None:
        raise ZooError(
            f"The eos_token {token!r} of {directory / TOKENIZER_CONFIG} is not a token of its "
            "tokenizer (tokenizer.json or added_tokens_decoder): the checkpoint's files disagree."
        )
    return found

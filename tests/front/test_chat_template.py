"""Chat templates render as transformers renders them: the real templates of Llama 3.1, Qwen 2.5,
Qwen 3 and Gemma 3 give, byte for byte, the text transformers' `apply_chat_template` gave for the
same conversations (`tests/fixtures/chat_templates/expected.json`, written by its
`make_expected.py`); `{% generation %}` spans give transformers' assistant token mask; templates
that reach outside the sandbox and malformed messages are refused by name."""

from __future__ import annotations

import json
import shutil
from datetime import datetime
from pathlib import Path

import pytest
from helpers import ROOT
from zoo.data.text import load_tokenizer
from zoo.engine.errors import ZooError

from zoo.chat_template import (
    ChatTemplate,
    end_of_turn_ids,
    has_generation_markers,
    read_chat_template,
    render_chat,
    render_chat_with_spans,
    special_tokens,
)

TEMPLATES = ROOT / "tests" / "fixtures" / "chat_templates"
EXPECTED = json.loads((TEMPLATES / "expected.json").read_text(encoding="utf-8"))
TINY = ROOT / "tests" / "fixtures" / "pretrained" / "qwen3-tiny"
USER = [{"role": "user", "content": "Hi"}]


def cases(expected: dict) -> list:
    return [
        pytest.param(name, case, id=f"{name}-{case['name']}-{case['add_generation_prompt']}")
        for name, template in expected.items()
        for case in template["cases"]
    ]


@pytest.mark.parametrize(("name", "case"), cases(EXPECTED["templates"]))
def test_a_real_template_renders_what_transformers_renders(name, case):
    chat = ChatTemplate.load(TEMPLATES / name)
    args = (case["messages"], case["add_generation_prompt"])
    if "error" in case:
        with pytest.raises(ZooError, match="The chat template (refused|failed)") as refused:
            chat.render(*args, **case["extra"])
        assert case["error"] in str(refused.value)
    else:
        assert chat.render(*args, **case["extra"]) == case["text"]


@pytest.mark.parametrize(("name", "case"), cases(EXPECTED["features"]))
def test_jinja_features_render_as_in_transformers(name, case):
    """Whitespace control, loop controls, `tojson`'s options, namespaces, `dict`, string
    methods, tests and filters, each as transformers' environment renders them."""
    args = (case["template"], case["messages"], case["add_generation_prompt"])
    assert render_chat(*args, **case["extra"]) == case["text"]


@pytest.mark.parametrize("name", sorted(EXPECTED["templates"]))
def test_the_special_tokens_are_those_transformers_passes(name):
    """The tokens the files name, as transformers passes them; a token only a tokenizer class's
    defaults add (GemmaTokenizer's `mask_token`) is one the template does not read."""
    passed = EXPECTED["templates"][name]["special_tokens"]
    tokens = special_tokens(TEMPLATES / name)
    assert tokens == {key: passed[key] for key in tokens}
    for key in passed.keys() - tokens.keys():
        assert key not in read_chat_template(TEMPLATES / name)


def test_special_tokens_are_read_in_each_form_a_checkpoint_keeps_them(tmp_path):
    config = {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True},
        "eos_token": "</s>",
        "pad_token": None,
        "add_bos_token": True,
        "image_token": "<image>",
        "extra_special_tokens": {"audio_token": "<audio>"},
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"unk_token": {"content": "?"}}))
    expected = {"bos_token": "<s>", "eos_token": "</s>", "image_token": "<image>"}
    assert special_tokens(tmp_path) == {**expected, "audio_token": "<audio>", "unk_token": "?"}
    config["added_tokens_decoder"] = {}  # then transformers reads no special_tokens_map.json
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert special_tokens(tmp_path) == {**expected, "audio_token": "<audio>"}


def test_the_template_file_comes_before_the_tokenizer_config_entry(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "from config"}))
    assert read_chat_template(tmp_path) == "from config"
    (tmp_path / "chat_template.jinja").write_text("from the file\n")
    assert read_chat_template(tmp_path) == "from the file\n"
    assert read_chat_template(TEMPLATES / "gemma-3-it").startswith("{{ bos_token }}")
    assert read_chat_template(TINY) is None


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ([{"name": "tool_use", "template": "x"}], r"named \['tool_use'\], none of them 'default'"),
        (42, "neither text nor a list"),
    ],
)
def test_a_malformed_template_entry_is_refused(tmp_path, entry, match):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": entry}))
    with pytest.raises(ZooError, match=match):
        read_chat_template(tmp_path)


def test_a_checkpoint_without_a_template_is_refused_by_name():
    with pytest.raises(ZooError, match="has no chat template: neither a chat_template.jinja"):
        ChatTemplate.load(TINY)


def test_a_token_the_template_reads_and_nobody_gives_is_refused():
    template = read_chat_template(TEMPLATES / "llama-3.1-instruct")
    with pytest.raises(ZooError, match="reads bos_token, which nothing gives"):
        render_chat(template, USER)
    assert render_chat(template, USER, bos_token="<s>").startswith("<s><|start_header_id|>")
    chat = ChatTemplate.load(TEMPLATES / "llama-3.1-instruct")
    assert chat.render(USER, bos_token="<s>").startswith("<s><|start_header_id|>")
    with pytest.raises(ZooError, match="A chat template is text, not a list"):
        render_chat(["{{ messages }}"], USER)


def test_strftime_now_is_today():
    assert render_chat("{{ strftime_now('%Y-%m') }}", USER) == datetime.now().strftime("%Y-%m")


GENERATION = EXPECTED["generation"]


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return load_tokenizer(TINY)


@pytest.mark.parametrize(("name", "case"), cases({GENERATION["template"]: GENERATION}))
def test_generation_spans_give_transformers_assistant_mask(name, case, tiny_tokenizer):
    chat = ChatTemplate.load(TEMPLATES / name)
    text, spans = chat.render_with_spans(case["messages"], case["add_generation_prompt"])
    assert text == case["text"]
    assert spans == [tuple(span) for span in case["spans"]]
    assert [text[start:end].endswith("<|im_end|>") for start, end in spans] == [True] * len(spans)
    encoding = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert encoding.ids == case["input_ids"]
    mask = [int(any(s < end and e > start for s, e in spans)) for start, end in encoding.offsets]
    assert mask == case["assistant_masks"]


def test_a_template_says_whether_it_marks_generation():
    assert has_generation_markers(read_chat_template(TEMPLATES / "chatml-generation"))
    assert not has_generation_markers(read_chat_template(TEMPLATES / "qwen3"))
    assert render_chat_with_spans("{{ messages[0].content }}", USER) == ("Hi", [])


def test_a_generation_block_rendered_away_from_its_place_is_refused():
    set_block = (
        "{% set reply %}{% generation %}{{ messages[0].content }}{% endgeneration %}{% endset %}"
        "say: {{ reply }}"
    )
    assert render_chat(set_block, USER) == "say: Hi"
    with pytest.raises(ZooError, match="block that rendered 'Hi' is not where the text holds it"):
        render_chat_with_spans(set_block, USER)


ESCAPES = [
    (
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "reaches for '__class__', '__mro__', '__subc",
    ),
    ("{{ messages['__class__'] }}", "reaches for '__class__'"),
    ("\n{{ messages|attr('__init__') }}", r"reaches for '__init__' \(line 2\)"),
    ("{{ cycler.__init__.__globals__.os }}", r"reaches for '__globals__', '__init__' \(line 1\)"),
    (
        "{{ messages|attr('_' ~ '_class__') }}",
        "outside its sandbox: access to attribute '__class__'",
    ),
    ("{{ ('{0._' ~ '_class__}').format(1) }}", "outside its sandbox: access to attribute '__cl"),
    ("{{ messages.append(1) }}", "outside its sandbox: access to attribute 'append'"),
    ("{% set x = messages[0].update(role='system') %}", "outside its sandbox.*'update'"),
    ("{% set ns = namespace(_x=1) %}", "outside its sandbox: a namespace stores no attribute"),
    ("{% set ns = namespace() %}{% set ns._y = 2 %}", "outside its sandbox.*named '_y'"),
    ("{{ range(10 ** 9) | list }}", "OverflowError: Range too big"),
    ("{{ raise_exception('ran first') }}{{ dict.__call__ }}", "reaches for '__call__'"),
]


@pytest.mark.parametrize(("template", "match"), ESCAPES)
def test_a_template_that_reaches_outside_the_sandbox_is_refused(template, match):
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ZooError, match=match):
        render_chat(template, messages)
    assert messages == [{"role": "user", "content": "Hi"}]


def test_a_template_is_given_plain_data_only():
    with pytest.raises(
        ZooError, match=r"extra_object is a PosixPath: a chat template is given text"
    ):
        render_chat("{{ extra_object }}", USER, extra_object=Path("/"))
    with pytest.raises(ZooError, match=r"messages\[0\]\['content'\]\[0\] is a bytes"):
        render_chat("x", [{"role": "user", "content": [b"raw"]}])


def test_a_template_that_does_not_parse_is_refused_with_its_line():
    with pytest.raises(ZooError, match="does not parse: line 2: "):
        render_chat("ok\n{% for %}", USER)


MALFORMED = [
    ("Hi", "messages must be a list of messages, not a str"),
    ({"role": "user", "content": "Hi"}, "messages must be a list of messages, not a dict"),
    ([], "messages is empty"),
    (["Hi"], r"messages\[0\] is a str \('Hi'\)"),
    ([{"content": "Hi"}], r"messages\[0\] has no role \(\{'content': 'Hi'\}\)"),
    ([{"role": 3, "content": "Hi"}], r"messages\[0\] has the role 3, which is not text"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant"}], r"messages\[1\] has no content"),
    ([{"role": "user", "content": None}], r"messages\[0\] has no content"),
    ([{"role": "user", "content": 7}], r"messages\[0\] has content of type int"),
    ([{"role": "user", "content": ["Hi"]}], r"messages\[0\] has content of type list"),
]


@pytest.mark.parametrize(("messages", "match"), MALFORMED)
def test_a_malformed_message_is_refused_by_name(messages, match):
    template = read_chat_template(TEMPLATES / "qwen3")
    with pytest.raises(ZooError, match=match) as refused:
        render_chat(template, messages)
    assert "a message is a dict with a 'role'" in str(refused.value)


def test_an_assistant_tool_call_needs_no_content():
    call = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}
    text = render_chat(read_chat_template(TEMPLATES / "qwen2.5-instruct"), [*USER, call], False)
    assert text.endswith('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n')


def write_checkpoint(directory: Path, generation: dict | None, tokenizer_config: dict) -> Path:
    directory.mkdir()
    shutil.copy(TINY / "tokenizer.json", directory)
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation))
    (directory / "config.json").write_text(json.dumps({"eos_token_id": 9}))
    return directory


def test_the_end_of_turn_ids_are_the_eos_ids_and_the_eos_token(tmp_path):
    assert end_of_turn_ids(TINY) == (0,)
    added = {"151645": {"content": "<|im_end|>", "special": True}}
    qwen = {"eos_token": "<|im_end|>", "added_tokens_decoder": added}
    listed = write_checkpoint(tmp_path / "qwen", {"eos_token_id": [151645, 151643]}, qwen)
    assert end_of_turn_ids(listed) == (151645, 151643)
    one = write_checkpoint(tmp_path / "one", {"eos_token_id": 5}, {"eos_token": "<|endoftext|>"})
    assert end_of_turn_ids(one) == (5, 0)
    bare = write_checkpoint(tmp_path / "bare", None, {})
    assert end_of_turn_ids(bare) == (9,)


def test_an_eos_token_the_tokenizer_lacks_is_refused(tmp_path):
    broken = write_checkpoint(tmp_path / "broken", {"eos_token_id": 1}, {"eos_token": "<|eot_id|>"})
    with pytest.raises(ZooError, match="The eos_token '<|eot_id|>' of .* is not a token"):
        end_of_turn_ids(broken)

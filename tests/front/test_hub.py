"""`hf://ORG/NAME` names read through huggingface_hub's cache, offline (HF_HUB_OFFLINE=1): a cache
laid out as the hub lays it out (refs/main -> snapshots/<commit>/ links -> blobs/), made from
the tiny GPT-2 fixture. `zoo.load`, `zoo.finetune`, the CLI's `finetune.init_from` (and its
resume), `python -m zoo.generate` and `zoo.serve` resolve it; names that cannot be had give one-paragraph
errors naming them and what to do, online errors included (a local server answers as the hub
answers an unknown and a gated repository)."""

from __future__ import annotations

import hashlib
import http.server
import os
import shutil
import threading
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import ROOT, generate_cli, run_cli
from zoo.data.text import load_tokenizer

import zoo

FIXTURES = ROOT / "tests" / "fixtures" / "pretrained"
TINY, TEXT = FIXTURES / "gpt2-tiny", FIXTURES / "tiny.txt"
REPO, COMMIT = "zoo-test/gpt2-tiny", "0123456789abcdef0123456789abcdef01234567"
NAME = f"hf://{REPO}"
TUNE = (
    f"data.path={TEXT}",
    "trainer.steps=2",
    "trainer.batch_size=8",
    "trainer.eval_every=2",
    "optimizer.warmup_steps=0",
)


def hub_cache(cache: Path, repo: str, source: Path, commit: str = COMMIT) -> Path:
    """`source`'s files as huggingface_hub keeps a download of `repo`: each file once under
    blobs/ (named by its hash), linked from snapshots/<commit>/, refs/main naming the commit."""
    storage = cache / f"models--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    for folder in (storage / "refs", storage / "blobs", snapshot):
        folder.mkdir(parents=True)
    (storage / "refs" / "main").write_text(commit)
    for file in sorted(source.iterdir()):
        blob = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, storage / "blobs" / blob)
        os.symlink(f"../../blobs/{blob}", snapshot / file.name)
    return snapshot


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The hub's cache holding the fixture, offline, for this process and its children."""
    root = tmp_path_factory.mktemp("hf-cache")
    snapshot = hub_cache(root, REPO, TINY)
    config_only = tmp_path_factory.mktemp("config-only")
    shutil.copyfile(TINY / "config.json", config_only / "config.json")
    hub_cache(root, "zoo-test/no-weights", config_only)
    from huggingface_hub import constants

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_CACHE", str(root))
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setattr(constants, "HF_HUB_CACHE", str(root))  # read when the module loaded
        patch.setattr(constants, "HF_HUB_OFFLINE", True)
        yield snapshot


def params(model: nnx.Module) -> dict[str, np.ndarray]:
    return {
        ".".join(map(str, path)): np.asarray(v[...])
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


def test_load_reads_a_hub_name_from_the_cache(cache):
    by_name = zoo.load(NAME, devices=jax.devices()[:1])
    assert by_name.workdir == str(cache)
    assert by_name.config.finetune.init_from == str(cache)  # the commit is in the path
    assert by_name.config.data.tokenizer == str(cache / "tokenizer.json")
    by_directory = params(zoo.load(TINY, devices=jax.devices()[:1]).model)
    assert params(by_name.model).keys() == by_directory.keys()
    for path, value in params(by_name.model).items():
        np.testing.assert_array_equal(value, by_directory[path], err_msg=path)
    pinned = zoo.load(f"{NAME}@{COMMIT}", devices=jax.devices()[:1])
    assert pinned.workdir == str(cache)


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("hf://zoo-test/missing", "is not in the Hugging Face cache"),
        (f"{NAME}@v2", "is not in the Hugging Face cache"),
        ("hf://zoo-test/gpt2-tiny/extra", "is not a Hugging Face Hub name"),
        ("hf://zoo-test/no-weights", "holds no checkpoint zoo reads"),
    ],
)
def test_names_the_cache_cannot_give_are_refused_by_name(cache, name, said):
    with pytest.raises(zoo.ZooError) as load_error:
        zoo.load(name)
    message = str(load_error.value)
    assert message.startswith(name) and said in message
    if "cache" in said:
        assert "HF_HUB_OFFLINE=1" in message and "hf download zoo-test/" in message
    with pytest.raises(zoo.ZooError, match=f"^{name}"):
        zoo.finetune(name, *TUNE)


def test_finetune_starts_from_a_hub_name(cache, tmp_path):
    result = zoo.finetune(NAME, *TUNE, f"workdir={tmp_path}")
    assert result.step == 2
    assert result.config.finetune.init_from == str(cache)
    assert result.config.model.vocab_size == 300  # the checkpoint's sizes and tokenizer
    assert result.config.data.window == 64  # fitted to its 64 positions (data.window unset)
    kept = load_tokenizer(tmp_path)  # the run keeps its tokenizer in its workdir
    assert kept.to_str() == load_tokenizer(TINY).to_str()


def test_the_cli_fine_tunes_from_a_hub_name_and_resumes_offline(cache, tmp_path):
    first = run_cli(f"finetune.init_from={NAME}", *TUNE, f"workdir={tmp_path}")
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"Starting from the gpt2 checkpoint in {cache}" in first.stderr
    recorded = (tmp_path / ".hydra" / "config.yaml").read_text()
    assert f"init_from: {cache}" in recorded
    assert NAME in (tmp_path / ".hydra" / "overrides.yaml").read_text()
    longer = run_cli(
        f"finetune.init_from={NAME}", *TUNE[:1], "trainer.steps=4", *TUNE[2:], f"workdir={tmp_path}"
    )
    assert longer.returncode == 0, longer.stdout + longer.stderr
    assert zoo.load(tmp_path).step == 4
    assert "Resuming at step 2" in longer.stderr


def test_the_generate_cli_takes_a_hub_name(cache):
    prompt = "def main():"
    result = generate_cli(NAME, f"prompt={prompt}", "max_new_tokens=4", "temperature=0")
    assert result.returncode == 0, result.stderr
    expected = zoo.generate(TINY, prompt, max_new_tokens=4, temperature=0)
    assert result.stdout == prompt + expected + "\n"
    missing = generate_cli("hf://zoo-test/missing", "prompt=x")
    assert missing.returncode == 2
    assert "error: hf://zoo-test/missing is not in the Hugging Face cache" in missing.stderr


def test_the_server_serves_a_hub_name(cache):
    from helpers import running

    from zoo.serve import create_app

    app = create_app(NAME, rows=1, max_length=32, queue_size=1)
    with running(app) as client:
        assert [m.id for m in client.models.list().data] == [NAME]
        reply = client.completions.create(model=NAME, prompt="def", max_tokens=4, temperature=0)
    assert reply.choices[0].text == zoo.generate(TINY, "def", max_new_tokens=4, temperature=0)


class FakeHub(http.server.BaseHTTPRequestHandler):
    """Answers as the hub answers a repository it does not show (404, RepoNotFound) and a gated
    one (403, GatedRepo)."""

    def do_GET(self):
        gated = "/gated" in self.path
        self.send_response(403 if gated else 404)
        self.send_header("X-Error-Code", "GatedRepo" if gated else "RepoNotFound")
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "no"}')

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


@pytest.fixture
def online(tmp_path, monkeypatch):
    """An empty cache, online, the hub being a local server."""
    from huggingface_hub import constants

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.server_port}")
    yield server
    server.shutdown()


@pytest.mark.parametrize(
    ("repo", "said"),
    [
        ("zoo-test/unknown", "has no model repository 'zoo-test/unknown'"),
        ("zoo-test/gated", "is a gated model: accept its conditions"),
    ],
)
def test_hub_answers_become_errors_naming_the_name(online, repo, said):
    with pytest.raises(zoo.ZooError) as error:
        zoo.load(f"hf://{repo}")
    assert str(error.value).startswith(f"hf://{repo}") and said in str(error.value)
    assert "HF_TOKEN" in str(error.value)


def test_an_unreachable_hub_falls_back_to_the_cache(cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens
    assert zoo.load(NAME, devices=jax.devices()[:1]).workdir == str(cache)
    with pytest.raises(zoo.ZooError, match="the Hugging Face Hub cannot be reached"):
        zoo.load("hf://zoo-test/missing")

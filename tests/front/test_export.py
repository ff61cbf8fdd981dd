"""`zoo.export` of a real fine-tuned run (a tiny GPT-2 checkpoint fine-tuned by the CLI with its
tokenizer, keeping an EMA of its weights): the `jax` export called in a fresh process that
imports only jax and numpy, the `hf` export loaded back bit for bit (the raw weights, or the
average with `weights=ema`), its end-of-text token named, transformers' logits equal to zoo's,
and `python -m zoo.export` as a user runs it."""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import ROOT, export_cli, run_cli
from zoo.engine.weights import pretrained as weights

import zoo
from zoo.hf_export import special_token_ids

zoo_export = importlib.import_module("zoo.export")  # the command (`zoo.export`: the function)
FIXTURES = ROOT / "tests" / "fixtures" / "pretrained"
TINY, TEXT = FIXTURES / "gpt2-tiny", FIXTURES / "tiny.txt"
FINETUNE = (
    f"finetune.init_from={TINY}",
    f"data.path={TEXT}",
    "data.window=16",
    "trainer.steps=4",
    "trainer.batch_size=8",
    "trainer.eval_every=4",
    "optimizer.warmup_steps=0",
    "optimizer.ema_decay=0.5",
)

CALL_JAX_EXPORT = """
import json, os, sys
import jax, numpy as np
out, inputs = sys.argv[1], np.load(sys.argv[2])
with open(os.path.join(out, "model.jaxexport"), "rb") as f:
    function = jax.export.deserialize(bytearray(f.read()))
with np.load(os.path.join(out, "weights.npz")) as npz:
    leaves = [npz[name] for name in sorted(npz.files)]
signature = json.load(open(os.path.join(out, "signature.json")))
assert list(inputs.shape) == signature["inputs"]["shape"], (inputs.shape, signature)
np.save(sys.argv[3], np.asarray(function.call(leaves, inputs)))
print(sorted(m for m in sys.modules if m.split(".")[0] == "zoo"))
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The workdir of a short CLI fine-tune of the tiny GPT-2 checkpoint on a text file."""
    workdir = tmp_path_factory.mktemp("gpt2-finetuned")
    result = run_cli(*FINETUNE, f"workdir={workdir}")
    assert result.returncode == 0, result.stderr
    return workdir


def params(directory, weights: str = "raw") -> dict:
    state = nnx.state(zoo.load(directory, weights=weights).model, nnx.Param)
    return {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(state)}


def test_jax_export_runs_in_a_process_with_jax_alone(run, tmp_path):
    out = zoo.export(run, tmp_path / "jax", format="jax")
    trained = zoo.load(run)
    context = trained.config.model.context_length
    tokens = np.random.default_rng(0).integers(0, 300, (1, context), dtype=np.int32)
    np.save(tmp_path / "tokens.npy", tokens)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    called = subprocess.run(
        [sys.executable, "-c", CALL_JAX_EXPORT, out, tmp_path / "tokens.npy", tmp_path / "out.npy"],
        cwd=tmp_path,  # not the repository: zoo's packages are not importable by path
        env={**env, "JAX_NUM_CPU_DEVICES": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert called.returncode == 0, called.stderr
    assert called.stdout.strip() == "[]"  # no zoo module was imported
    np.testing.assert_allclose(
        np.load(tmp_path / "out.npy"), zoo.predict(trained, tokens), atol=1e-5, rtol=0
    )


def test_hf_export_of_a_run_loads_back_bit_identical(run, tmp_path):
    out = zoo.export(run, tmp_path / "hf", format="hf")
    assert weights.open_pretrained(out).family.name == "gpt2"
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (
        TINY / "tokenizer.json"
    ).read_bytes()
    before, after = params(run), params(out)
    assert before.keys() == after.keys()
    for path in before:
        np.testing.assert_array_equal(before[path], after[path], err_msg=str(path))


def test_export_cli_writes_both_formats_the_hf_one_of_the_average(run, tmp_path):
    for format, written in (("hf", "model.safetensors"), ("jax", "model.jaxexport")):
        result = export_cli(run, tmp_path / format, f"format={format}", "weights=ema")
        assert result.returncode == 0, result.stderr
        assert "RuntimeWarning" not in result.stderr
        assert result.stdout.strip() == str(tmp_path / format)
        assert (tmp_path / format / written).is_file()
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["vocab_size"] == 300
    assert config["bos_token_id"] == config["eos_token_id"] == 0  # the tokenizer's <|endoftext|>
    average, exported, raw = params(run, "ema"), params(tmp_path / "hf"), params(run)
    assert average.keys() == exported.keys()
    for path in average:
        np.testing.assert_array_equal(average[path], exported[path], err_msg=str(path))
    assert any(not np.array_equal(average[path], raw[path]) for path in raw)


def test_export_cli_refuses_bad_input_before_writing(tmp_path, capsys):
    """The CLI's own `main`, in process (the command itself runs in the test above)."""
    for arg, message in (
        ("format=onnx", "format='onnx' is not an export format: choose one of hf, jax"),
        ("weights=ema", "is a pretrained directory, which holds one set of weights and no average"),
    ):
        assert zoo_export.main([str(TINY), str(tmp_path / "out"), arg]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "tokenizer, vocab_size, expected",
    [(None, 256, None), (None, 50257, 50256), (TINY / "tokenizer.json", 300, 0)],
    ids=["bytes", "gpt2-vocabulary", "tokenizer"],
)
def test_the_end_of_text_token_comes_from_the_tokenizer_or_gpt2s_vocabulary(
    tokenizer, vocab_size, expected
):
    ids = special_token_ids(tokenizer and str(tokenizer), vocab_size)
    assert ids == {"bos_token_id": expected, "eos_token_id": expected}


def test_transformers_loads_the_export_with_the_runs_logits(run, tmp_path, caplog):
    pytest.importorskip("transformers")
    import torch
    from transformers import GPT2LMHeadModel

    out = zoo.export(run, tmp_path / "hf", format="hf")
    with caplog.at_level(logging.WARNING):
        reference = GPT2LMHeadModel.from_pretrained(out).eval()
        tokens = np.random.default_rng(0).integers(0, 300, (1, 16), dtype=np.int32)
        with torch.no_grad():
            live = reference(torch.from_numpy(tokens).long()).logits.numpy()
    assert not [r.getMessage() for r in caplog.records if "token_id" in r.getMessage()]
    with jax.default_matmul_precision("highest"):
        expected = zoo.predict(zoo.load(run, devices=jax.devices()[:1]), tokens)
    np.testing.assert_allclose(live, expected[..., :300], atol=1e-5, rtol=0)

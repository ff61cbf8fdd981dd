"""`zoo.generate` speaks the model's tokenizer: prompts encoded and samples decoded by it for a
pretrained directory and for a run fine-tuned from one (its eval-time sample too), byte-level
otherwise (tests/models/test_gpt.py); a run trained in bf16 generates in bf16; `python -m
zoo.generate DIR prompt=...` prints what the function writes."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import ROOT, generate_cli, run_cli
from zoo.data.text import load_tokenizer
from zoo.engine.steps.precision import computing
from zoo.engine.steps.rngs import on_eval_key
from zoo.models.text_completion import generate_tokens

import zoo
from zoo import text_generation

FIXTURES = ROOT / "tests" / "fixtures" / "pretrained"
TINY, TEXT = FIXTURES / "gpt2-tiny", FIXTURES / "tiny.txt"
TOKENIZER = load_tokenizer(TINY)
zoo_generate = importlib.import_module("zoo.generate")  # the command (`zoo.generate`: the function)
PROMPT = "def main():\n    return"
DATA = {"path": str(TEXT), "window": 16, "tokenizer": str(TINY)}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A short CLI fine-tune of the tiny GPT-2 checkpoint on a text file in bf16, one eval."""
    workdir = tmp_path_factory.mktemp("gpt2-finetuned")
    result = run_cli(
        f"finetune.init_from={TINY}",
        *(f"data.{key}={value}" for key, value in DATA.items() if key != "tokenizer"),
        "trainer.steps=2",
        "trainer.batch_size=8",
        "trainer.precision=bf16",
        "trainer.eval_every=2",
        "optimizer.warmup_steps=0",
        f"workdir={workdir}",
    )
    assert result.returncode == 0, result.stderr
    return workdir


def spy(function, called: list):
    def recording(model, *args, **kwargs):
        called.append(model)
        return function(model, *args, **kwargs)

    return recording


def greedy_by_full_forward(trained, ids: list[int], count: int) -> list[int]:
    """The likeliest next tokens one by one, each from the model run over the whole sequence."""
    ids = list(ids)
    for _ in range(count):
        logits = zoo.predict(trained, np.asarray([ids], np.int32))
        ids.append(int(np.argmax(logits[0, -1])))
    return ids[-count:]


def test_a_pretrained_directory_generates_through_its_tokenizer():
    text = zoo.generate(TINY, PROMPT, max_new_tokens=4, temperature=0)
    trained = zoo.load(TINY, devices=jax.devices()[:1])
    prompt_ids = TOKENIZER.encode(PROMPT, add_special_tokens=False).ids
    assert len(prompt_ids) < len(PROMPT)  # merges: ids are not bytes
    expected = greedy_by_full_forward(trained, prompt_ids, 4)
    assert text == TOKENIZER.decode(expected, skip_special_tokens=False)


def test_a_bf16_run_with_a_tokenizer_generates_and_samples_through_it_in_bf16(run, monkeypatch):
    trained = zoo.load(run)
    assert trained.config.data.tokenizer == str(TINY / "tokenizer.json")
    called = []
    monkeypatch.setattr(text_generation, "complete", spy(text_generation.complete, called))
    from_dir = zoo.generate(run, PROMPT, max_new_tokens=6, seed=3)
    (model,) = called
    dtypes = {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))}
    assert dtypes == {jnp.dtype(jnp.bfloat16)}  # computed as the run trained
    assert trained.model.embedding[...].dtype == jnp.float32  # the loaded params stay float32
    with trained.activate():
        assert model.empty_cache(8, 16)[0][0].dtype == jnp.bfloat16  # 8: a batch the mesh splits
        low = computing(trained.model, "bf16")
        bare = zoo.generate(low, PROMPT, 6, seed=3, tokenizer=TINY / "tokenizer.json")
    assert from_dir == bare

    # The eval-time sample: the first held-out example's start, continued and decoded (bf16).
    first = zoo.load_data("text", **DATA).eval
    prompt = first["tokens"][0][: min(int(first["length"][0]), 32)]
    with trained.activate():
        new = generate_tokens(low, prompt, 32, temperature=0.8, seed=on_eval_key(0, 2))
    shown, written = TOKENIZER.decode(prompt.tolist()), TOKENIZER.decode(new.tolist())
    log = (run / "train.log").read_text()
    assert f"sample @ step 2: {shown!r} -> {written!r}" in log


def test_generate_cli_prints_prompt_and_continuation():
    result = generate_cli(TINY, f"prompt={PROMPT}", "max_new_tokens=5", "temperature=0.7", "seed=1")
    assert result.returncode == 0, result.stderr
    assert "RuntimeWarning" not in result.stderr
    expected = PROMPT + zoo.generate(TINY, PROMPT, 5, temperature=0.7, seed=1)
    assert result.stdout == expected + "\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("max_new_tokens=many",), r"max_new_tokens='many' is not a number"),
        (("max_new_tokens=64",), r"max_new_tokens=64 must lie between 1 and context_length - 1"),
        ((), r"usage: python -m zoo.generate DIR prompt=TEXT"),
    ],
    ids=["not-a-number", "too-long", "no-prompt"],
)
def test_generate_cli_refuses_bad_options(args, message, capsys):
    """The CLI's own `main`, in process (the command itself runs in the test above)."""
    prompt = () if not args else (f"prompt={PROMPT}",)
    assert zoo_generate.main([str(TINY), *prompt, *args]) == 2
    stderr = capsys.readouterr().err
    assert re.search(message, stderr), stderr


NAMES_KEPT = """
import runpy, sys
import zoo.generate  # the package before `zoo`: zoo/__init__ runs inside its import
import zoo
assert getattr(zoo.generate, "__module__", None) == "zoo.text_generation", zoo.generate
sys.argv = ["zoo.export"]
try:
    runpy.run_module("zoo.export", run_name="__main__")  # python -m zoo.export
except SystemExit as e:
    assert e.code == 2, e.code  # its usage
assert getattr(zoo.export, "__module__", None) == "zoo.exporting", zoo.export
"""


def test_the_commands_leave_their_names_to_the_functions():
    """`zoo.generate` and `zoo.export` each name a function and a package (its command line):
    importing the package before `zoo`, or running its command, leaves the name on the
    function (a fresh process: this one imported both long ago)."""
    result = subprocess.run(
        [sys.executable, "-c", NAMES_KEPT],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr

"""`zoo.finetune(DIR, ...)` from a pretrained GPT-2 checkpoint (the tiny fixture written by
transformers) on a text file, through its tokenizer: with frozen params, and with LoRA
adapters that merge back into a model of the checkpoint's own layout."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from helpers import ROOT

import zoo
from train import weights

FIXTURES = ROOT / "tests" / "fixtures" / "pretrained"
TINY, TEXT = FIXTURES / "gpt2-tiny", FIXTURES / "tiny.txt"
TUNE = (
    f"data.path={TEXT}",
    "data.window=16",
    "trainer.steps=3",
    "trainer.batch_size=8",
    "trainer.eval_every=3",
    "optimizer.warmup_steps=0",
    "optimizer.schedule=constant",
    "optimizer.learning_rate=1e-2",
)


def params(model: nnx.Module) -> dict[str, np.ndarray]:
    """Dotted path -> value of every param, LoRA wrappers' `base_module` left out of the path."""
    state = nnx.state(model, nnx.Param)
    return {
        ".".join(str(p) for p in path if p != "base_module"): np.asarray(v[...])
        for path, v in nnx.to_flat_state(state)
    }


@pytest.fixture(scope="module")
def pretrained():
    return params(zoo.load(TINY).model)


def test_frozen_params_keep_the_checkpoint_s_values(pretrained, tmp_path):
    frozen = r"blocks\.0|embedding|positions"
    result = zoo.finetune(TINY, *TUNE, f"workdir={tmp_path}", freeze=frozen)
    assert result.config.data.tokenizer == str(TINY / "tokenizer.json")
    assert "bits_per_token" in result.eval_metrics
    tuned = params(result.model)
    assert tuned.keys() == pretrained.keys()
    for path, value in tuned.items():
        if path.startswith(("blocks.0.", "embedding", "positions")):
            np.testing.assert_array_equal(value, pretrained[path], err_msg=path)
        else:
            assert not np.array_equal(value, pretrained[path]), path


def test_lora_trains_adapters_only_and_merges_into_the_checkpoint_layout(pretrained, tmp_path):
    result = zoo.finetune(TINY, *TUNE, f"workdir={tmp_path}", lora_rank=4, lora_layers="blocks")
    adapters = nnx.state(result.model, nnx.LoRAParam)
    assert len(nnx.to_flat_state(adapters)) > 0
    tuned = params(result.model)
    for path, value in pretrained.items():  # the base weights are untouched
        np.testing.assert_array_equal(tuned[path], value, err_msg=path)

    loaded = zoo.load(tmp_path)  # rebuilt from the run's config alone, adapters included
    tokens = np.load(TINY / "reference.npz")["tokens"]
    with_adapters = zoo.predict(loaded, tokens)
    loaded = zoo.merge_lora(loaded)
    np.testing.assert_allclose(zoo.predict(loaded, tokens), with_adapters, atol=1e-5, rtol=0)
    merged = params(loaded.model)
    assert merged.keys() == pretrained.keys()
    assert not np.array_equal(
        merged["blocks.0.mlp_in.kernel"], pretrained["blocks.0.mlp_in.kernel"]
    )
    family = weights.open_pretrained(TINY).family
    tensors = weights.export_tensors(loaded.model, family, zoo.api.resolved_hparams(loaded.config))
    assert "transformer.h.0.attn.c_attn.weight" in tensors


def test_a_step_is_refused_for_a_pretrained_directory(tmp_path):
    with pytest.raises(zoo.ZooError, match="holds one set of weights: step='best'"):
        zoo.finetune(TINY, *TUNE, f"workdir={tmp_path}", step="best")
    assert not any(tmp_path.iterdir())

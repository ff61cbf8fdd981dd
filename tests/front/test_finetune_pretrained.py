"""`zoo.finetune(DIR, ...)` from a pretrained GPT-2 checkpoint (the tiny fixture written by
transformers) on a text file, through its tokenizer: with frozen params, and with LoRA
adapters that merge back into a model of the checkpoint's own layout."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from helpers import ROOT, TINY_TEXT_FINETUNE
from zoo.engine.weights import pretrained as weights

import zoo
from zoo.trained import resolved_hparams

FIXTURES = ROOT / "tests" / "fixtures" / "pretrained"
TINY, TEXT = FIXTURES / "gpt2-tiny", FIXTURES / "tiny.txt"
TUNE = TINY_TEXT_FINETUNE


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


class Recorder:
    """Every hook's calls, in order."""

    def __init__(self):
        self.calls = []

    def on_train_window(self, step, metrics):
        self.calls.append(("window", step, float(metrics["loss"])))

    def on_eval(self, step, metrics):
        self.calls.append(("eval", step, float(metrics["loss"])))

    def on_checkpoint(self, step, path):
        self.calls.append(("checkpoint", step, path))

    def on_end(self, result):
        self.calls.append(("end", result.step, None))


def test_frozen_params_keep_the_checkpoint_s_values(pretrained, tmp_path):
    frozen = r"blocks\.0|embedding|positions"
    recorder = Recorder()
    args = (*TUNE, "trainer.log_every=1", f"workdir={tmp_path}")
    result = zoo.finetune(TINY, *args, freeze=frozen, callbacks=[recorder])
    kinds = [(kind, step) for kind, step, _ in recorder.calls]
    windows = [("window", 1), ("window", 2), ("window", 3)]
    assert kinds == [*windows, ("eval", 3), ("checkpoint", 3), ("end", 3)], kinds
    assert recorder.calls[3][2] == pytest.approx(result.eval_metrics["loss"])
    assert recorder.calls[4][2] == str(tmp_path / "checkpoints" / "3")
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
    adapters = {
        ".".join(map(str, path)): value
        for path, value in nnx.to_flat_state(nnx.state(result.model, nnx.LoRAParam))
    }
    # Attention's projections to and from heads take adapters shaped like their kernels.
    assert adapters["blocks.0.attention.query.lora_b"].shape == (4, 4, 16)
    assert adapters["blocks.0.attention.out.lora_a"].shape == (4, 16, 4)
    assert adapters["blocks.0.mlp_in.lora_a"].shape == (64, 4)
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
    for kernel in ("mlp_in", "attention.query", "attention.out"):
        path = f"blocks.0.{kernel}.kernel"
        assert not np.array_equal(merged[path], pretrained[path]), path
    family = weights.open_pretrained(TINY).family
    tensors = weights.export_tensors(loaded.model, family, resolved_hparams(loaded.config))
    assert "transformer.h.0.attn.c_attn.weight" in tensors


def test_a_step_is_refused_for_a_pretrained_directory(tmp_path):
    with pytest.raises(zoo.ZooError, match="holds one set of weights: step='best'"):
        zoo.finetune(TINY, *TUNE, f"workdir={tmp_path}", step="best")
    assert not any(tmp_path.iterdir())

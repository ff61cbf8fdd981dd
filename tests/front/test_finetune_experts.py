"""Fine-tuning a mixture-of-experts checkpoint (the tiny Qwen3-MoE fixture, written by
transformers): every param trained, experts and router included; LoRA over the attention
projections with the experts frozen; and LoRA asked of the experts, which adapters cannot wrap
yet, refused by name before anything is written."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from helpers import ROOT, TINY_TEXT_FINETUNE

import zoo
from zoo.plugin import ZooError

CHECKPOINT = ROOT / "tests" / "fixtures" / "pretrained" / "qwen3-moe-tiny"
ATTENTION = r"layers\.\d+\.attention"


def params(model: nnx.Module) -> dict[str, np.ndarray]:
    """Dotted path -> value of every param, LoRA wrappers' `base_module` left out of the path."""
    return {
        ".".join(str(p) for p in path if p != "base_module"): np.asarray(v[...])
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


@pytest.fixture(scope="module")
def pretrained():
    return params(zoo.load(CHECKPOINT).model)


def test_a_full_fine_tune_trains_the_experts_and_the_router(pretrained, tmp_path):
    result = zoo.finetune(CHECKPOINT, *TINY_TEXT_FINETUNE, f"workdir={tmp_path}")
    tuned = params(result.model)
    for path in (
        "layers.1.mlp.experts.gate",
        "layers.2.mlp.router.kernel",
        "layers.0.mlp.up.kernel",
    ):
        assert not np.array_equal(tuned[path], pretrained[path]), path
    assert np.isfinite(result.eval_metrics["loss"])


def test_lora_on_the_attention_leaves_the_experts_as_they_were(pretrained, tmp_path):
    result = zoo.finetune(
        CHECKPOINT, *TINY_TEXT_FINETUNE, f"workdir={tmp_path}", lora_rank=4, lora_layers=ATTENTION
    )
    adapted = {
        ".".join(map(str, path))
        for path, _ in nnx.to_flat_state(nnx.state(result.model, nnx.LoRAParam))
    }
    assert "layers.1.attention.query.lora_a" in adapted
    assert not any(".mlp." in path for path in adapted)
    tuned = params(result.model)
    for path, value in pretrained.items():
        np.testing.assert_array_equal(tuned[path], value, err_msg=path)


def test_lora_asked_of_the_experts_is_refused_before_anything_is_written(tmp_path):
    workdir = tmp_path / "run"
    with pytest.raises(ZooError) as refused:
        zoo.finetune(CHECKPOINT, *TINY_TEXT_FINETUNE, f"workdir={workdir}", lora_rank=4)
    message = str(refused.value)
    assert "lora_layers='.*' matches layers.1.mlp, layers.2.mlp" in message, message
    assert "a mixture of experts" in message and "attention" in message
    assert not workdir.exists()

"""Fine-tuning DeepSeek V3 (the tiny fixture written by transformers: latent attention with
query and key/value compression, a dense first layer, routed experts beside a shared MLP,
sigmoid routing with a correction bias): every param trained, the correction bias (a statistic
of the experts' load, not a param) left as the checkpoint holds it; LoRA over the latent
attention's projections, the experts and the shared MLP, merged into their kernels; QLoRA with
the experts' kernels held quantized."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from helpers import ROOT, TINY_TEXT_FINETUNE
from zoo.engine.weights.quantize import Quantized

import zoo

CHECKPOINT = ROOT / "tests" / "fixtures" / "pretrained" / "deepseek-v3-tiny"
PROMPT = np.arange(1, 17, dtype=np.int32)[None]


def flat(model: nnx.Module, kind: type) -> dict[str, np.ndarray]:
    """Dotted path -> value of every `kind` variable, LoRA wrappers' `base_module` left out."""
    return {
        ".".join(str(p) for p in path if p != "base_module"): np.asarray(v[...])
        for path, v in nnx.to_flat_state(nnx.state(model, kind))
    }


@pytest.fixture(scope="module")
def pretrained():
    model = zoo.load(CHECKPOINT).model
    return flat(model, nnx.Param), flat(model, nnx.BatchStat)


def test_a_full_fine_tune_trains_experts_and_router_but_not_the_correction_bias(
    pretrained, tmp_path
):
    params, stats = pretrained
    result = zoo.finetune(CHECKPOINT, *TINY_TEXT_FINETUNE, f"workdir={tmp_path}")
    tuned = flat(result.model, nnx.Param)
    for path in (
        "layers.1.mlp.experts.gate",
        "layers.2.mlp.experts.down",
        "layers.1.mlp.router.kernel",
        "layers.2.mlp.shared.up.kernel",
        "layers.1.attention.kv_up.kernel",
    ):
        assert not np.array_equal(tuned[path], params[path]), path
    bias = flat(result.model, nnx.BatchStat)
    assert sorted(bias) == [
        "layers.1.mlp.router.correction_bias",
        "layers.2.mlp.router.correction_bias",
    ]
    for path, value in stats.items():
        assert np.abs(value).max() > 0, path  # the fixture's bias is not zero
        np.testing.assert_array_equal(bias[path], value, err_msg=path)
    assert np.isfinite(result.eval_metrics["loss"])


def test_lora_over_the_latent_attention_and_the_experts_merges_into_the_kernels(
    pretrained, tmp_path
):
    """The default `lora_layers` adapts every projection of the latent attention, each expert
    (stacked), the shared MLP and the dense layer's MLP; only the adapters train; merged, each
    kernel is kernel + the adapter's product and the model computes what the adapted one
    does."""
    params, _ = pretrained
    result = zoo.finetune(CHECKPOINT, *TINY_TEXT_FINETUNE, f"workdir={tmp_path}", lora_rank=4)
    adapters = flat(result.model, nnx.LoRAParam)
    layer = "layers.1"
    for name in ("query_down", "query", "kv_down", "kv_up", "out"):
        assert np.abs(adapters[f"{layer}.attention.{name}.lora_b"]).max() > 0, name
    for name in ("shared.gate", "shared.down"):
        assert f"{layer}.mlp.{name}.lora_a" in adapters, name
    tuned = flat(result.model, nnx.Param)
    for path, value in params.items():
        np.testing.assert_array_equal(tuned[path], value, err_msg=path)
    merged = zoo.merge_lora(result)
    folded = flat(merged.model, nnx.Param)
    assert folded.keys() == params.keys() and not nnx.state(merged.model, nnx.LoRAParam)
    delta = {  # each kernel as the checkpoint lays it out: (outputs..., inputs...)
        "attention.kv_up.kernel": ("ir,rhd->hdi", "kv_up"),
        "attention.out.kernel": ("hdr,ro->ohd", "out"),
        "mlp.shared.down.kernel": ("ir,ro->oi", "shared.down"),
    }
    for path, (spec, name) in delta.items():
        module = "attention" if path.startswith("attention") else "mlp"
        a, b = (adapters[f"{layer}.{module}.{name}.lora_{x}"] for x in "ab")
        expected = params[f"{layer}.{path}"] + np.einsum(spec, a, b)
        np.testing.assert_allclose(folded[f"{layer}.{path}"], expected, atol=1e-6, err_msg=path)
    experts = f"{layer}.mlp.experts"
    a, b = (adapters[f"{experts}.up_lora_{x}"] for x in "ab")
    expected = params[f"{experts}.up"] + np.einsum("eor,eri->eoi", b, a)
    np.testing.assert_allclose(folded[f"{experts}.up"], expected, atol=1e-6)
    np.testing.assert_allclose(
        zoo.predict(merged, PROMPT), zoo.predict(result, PROMPT), rtol=1e-4, atol=1e-4
    )


def test_qlora_holds_the_experts_quantized_and_merges_them(pretrained, tmp_path):
    params, stats = pretrained
    result = zoo.finetune(
        CHECKPOINT, *TINY_TEXT_FINETUNE, f"workdir={tmp_path}", lora_rank=4, quantize="int4"
    )
    held = {
        ".".join(map(str, path)): module
        for path, module in nnx.iter_modules(result.model)
        if isinstance(module, Quantized)
    }
    assert sorted(held) == [
        f"layers.{i}.mlp.experts.{p}" for i in (1, 2) for p in ("down", "gate", "up")
    ]
    for path, kernel in held.items():
        with result.activate():  # dequantized under the run's mesh
            error = np.abs(np.asarray(kernel[...]) - params[path]).max()
        assert 0 < error <= np.abs(params[path]).max() * 0.5 / 7, path  # int4's half step
    tuned = flat(result.model, nnx.Param)
    assert "layers.1.attention.kv_up.kernel" not in tuned  # held quantized too (a dense layer)
    assert np.array_equal(tuned["layers.1.mlp.router.kernel"], params["layers.1.mlp.router.kernel"])
    for path, value in flat(result.model, nnx.BatchStat).items():
        np.testing.assert_array_equal(value, stats[path], err_msg=path)
    merged = zoo.merge_lora(result)
    assert flat(merged.model, nnx.Param).keys() == params.keys()
    np.testing.assert_allclose(
        zoo.predict(merged, PROMPT), zoo.predict(result, PROMPT), rtol=1e-4, atol=1e-4
    )

"""gpt-oss's MXFP4 experts held as the hub stores them under LoRA (`finetune.quantize=mxfp4`):
quantizing a kernel decoded from MXFP4 gives back its blocks and scales, and dequantizes to it
bit for bit; a QLoRA fine-tune of the hub-layout fixture holds each expert kernel as the hub's
own bytes, decodes the kernels zoo's loader decodes, trains the adapters on top and merges
them."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import ROOT, TINY_TEXT_FINETUNE
from safetensors.numpy import load_file
from zoo.engine.weights import dequantize_mxfp4
from zoo.engine.weights.quantize import MXFP4, Layout, Quantized, dequantize, quantize

import zoo

CHECKPOINT = ROOT / "tests" / "fixtures" / "pretrained" / "gpt-oss-mxfp4"
EXPERTS = r"layers\.\d+\.mlp\.experts"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_decoded_mxfp4_kernel_quantizes_to_its_blocks_and_back_bit_for_bit(dtype):
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 5, 2, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, (3, 5, 2), dtype=np.uint8)
    decoded = dequantize_mxfp4(blocks, scales).transpose(0, 2, 1)  # [experts, out, in]
    kernel = jnp.asarray(decoded, dtype)
    layout = Layout(kernel.shape, jnp.dtype(dtype), 2, MXFP4)
    codes, exponents = quantize(kernel, layout)
    np.testing.assert_array_equal(np.asarray(codes), blocks.reshape(3, 5, 32))
    np.testing.assert_array_equal(np.asarray(exponents), scales)
    back = np.asarray(dequantize(codes, exponents, layout))
    bits = np.uint16 if dtype == jnp.bfloat16 else np.uint32
    np.testing.assert_array_equal(back.view(bits), np.asarray(kernel).view(bits))


def test_qlora_holds_the_hub_s_mxfp4_experts_and_decodes_them_as_the_loader(tmp_path):
    result = zoo.finetune(
        CHECKPOINT,
        *TINY_TEXT_FINETUNE,
        f"workdir={tmp_path}",
        lora_rank=4,
        lora_layers=EXPERTS,
        quantize="mxfp4",
    )
    decoded = {
        ".".join(map(str, path)): np.asarray(v[...])
        for path, v in nnx.to_flat_state(nnx.state(zoo.load(CHECKPOINT).model, nnx.Param))
    }
    hub = load_file(CHECKPOINT / "model.safetensors")
    held = {
        ".".join(map(str, path)): module
        for path, module in nnx.iter_modules(result.model)
        if isinstance(module, Quantized)
    }
    assert len(held) == 6  # gate, up, down of 2 layers
    for path, kernel in held.items():
        layer, name = path.split(".")[1], path.rsplit(".", 1)[1]
        stored = "down" if name == "down" else "gate_up"
        blocks = hub[f"model.layers.{layer}.mlp.experts.{stored}_proj_blocks"]
        rows = {"gate": slice(0, None, 2), "up": slice(1, None, 2), "down": slice(None)}[name]
        blocks = blocks[:, rows]
        np.testing.assert_array_equal(
            np.asarray(kernel.codes[...]), blocks.reshape(*blocks.shape[:2], -1), err_msg=path
        )
        with result.activate():
            np.testing.assert_array_equal(np.asarray(kernel[...]), decoded[path], err_msg=path)
    adapters = nnx.state(result.model, nnx.LoRAParam)
    assert np.abs(np.asarray(adapters["layers"][1]["mlp"]["experts"]["down_lora_b"][...])).max() > 0
    merged = zoo.merge_lora(result)
    assert not nnx.state(merged.model, nnx.LoRAParam)
    prompt = np.arange(1, 17, dtype=np.int32)[None]
    np.testing.assert_allclose(
        zoo.predict(merged, prompt), zoo.predict(result, prompt), rtol=1e-4, atol=1e-4
    )

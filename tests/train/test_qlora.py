"""QLoRA (`finetune.quantize`): the adapted layers' base kernels held quantized (int8, int4, nf4)
and frozen, the adapters trained on top, on the tiny Qwen 3 and Llama fixtures written by
transformers. Quantization error within each format's bound; an untrained adapter computing
exactly the model of the dequantized kernels; a fine-tune that changes the adapters alone and
leaves the codes as the checkpoint's kernels quantize; a merge and an export that give the
dequantized kernel plus `lora_a @ lora_b`; settings refused by name."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import ROOT, TINY_TEXT_FINETUNE, run_cli
from zoo.engine.errors import ZooError
from zoo.engine.weights.lora import ShardedLoRA, add_adapters
from zoo.engine.weights.quantize import QTYPES, TILE, Layout, dequantize, quantize

import zoo

FIXTURES = ROOT / "tests" / "fixtures" / "pretrained"
QWEN, LLAMA, TEXT = FIXTURES / "qwen3-tiny", FIXTURES / "llama-tiny", FIXTURES / "tiny.txt"
TUNE = TINY_TEXT_FINETUNE
# Largest |dequantized - kernel| over a block's absmax: half a step of the format's grid (int8:
# absmax at 127.5 steps, int4: 7.5, bounded here by 127 and 7 for the clipped edge of the grid;
# nf4: half its widest gap, between -1 and -0.6962).
BOUND = {"int8": 0.5 / 127, "int4": 0.5 / 7, "nf4": (1 - 0.6961928009986877) / 2}


def adapters(model: nnx.Module) -> dict[str, ShardedLoRA]:
    return {
        ".".join(map(str, path)): module
        for path, module in nnx.iter_modules(model)
        if isinstance(module, ShardedLoRA)
    }


def kernels(model: nnx.Module) -> dict[str, np.ndarray]:
    """Dotted path of each layer -> its kernel, for the layers the decoder's `layers` hold."""
    return {
        ".".join(map(str, path)): np.asarray(module.kernel[...])
        for path, module in nnx.iter_modules(model)
        if path and path[0] == "layers" and hasattr(module, "kernel")
    }


def with_qlora(loaded: zoo.TrainedModel, qtype: str) -> zoo.TrainedModel:
    """`loaded` with adapters (rank 4) on every projection of its layers, kernels quantized."""
    with loaded.activate():
        model = nnx.clone(loaded.model)
        add_adapters(model, 4, "layers", nnx.Rngs(0), qtype)
    return dataclasses.replace(loaded, model=model)


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def fixture_kernels(request):
    return kernels(zoo.load(QWEN if request.param == "qwen3" else LLAMA).model)


def test_dequantized_kernels_lie_within_each_format_s_bound(fixture_kernels):
    errors = {}
    for qtype in QTYPES:
        relative = []
        for path, kernel in fixture_kernels.items():
            layout = Layout(kernel.shape, jnp.dtype(kernel.dtype), kernel.ndim - 1, qtype)
            codes, scale = quantize(jnp.asarray(kernel), layout)
            restored = np.asarray(dequantize(codes, scale, layout))
            assert restored.shape == kernel.shape and restored.dtype == kernel.dtype, path
            # one scale per output channel and per TILE inputs where TILE divides them
            tiles = kernel.shape[-1] // TILE if kernel.shape[-1] % TILE == 0 else 1
            assert scale.shape == (*kernel.shape[:-1], tiles), path
            packed = kernel.shape[-1] // (1 if qtype == "int8" else 2)
            assert codes.shape == (*kernel.shape[:-1], packed), path
            blocks = kernel.reshape(*kernel.shape[:-1], tiles, -1)
            absmax = np.abs(blocks).max(axis=-1, keepdims=True)
            error = np.abs(restored.reshape(blocks.shape) - blocks)
            assert (error <= BOUND[qtype] * absmax * (1 + 1e-5)).all(), (qtype, path)
            relative.append(np.sqrt((error**2).mean() / (blocks**2).mean()))
        errors[qtype] = float(np.mean(relative))
    # relative RMS errors here: int8 0.6%, nf4 8.6%, int4 9.4% (normal weights suit nf4)
    assert errors["int8"] < 0.01 and errors["int8"] < errors["nf4"] < errors["int4"] < 0.12, errors


def test_quantizing_gives_the_same_bits_every_time():
    kernel = jax.random.normal(jax.random.key(0), (48, 128), jnp.float32)
    for qtype in QTYPES:
        layout = Layout((48, 128), jnp.dtype(jnp.float32), 1, qtype)
        first, again = quantize(kernel, layout), quantize(kernel + 0, layout)
        for a, b in zip(first, again, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.fixture(scope="module")
def qwen():
    return zoo.load(QWEN)


@pytest.mark.parametrize("qtype", QTYPES)
def test_an_untrained_qlora_model_computes_the_model_of_its_dequantized_kernels(qwen, qtype):
    loaded = qwen
    quantized = with_qlora(loaded, qtype)
    plain = nnx.clone(loaded.model)
    with loaded.activate():
        for path, adapter in adapters(quantized.model).items():
            layer = plain
            for part in path.split("."):
                layer = layer[int(part)] if part.isdigit() else getattr(layer, part)
            layer.kernel[...] = adapter.base_kernel()
    tokens = np.load(QWEN / "reference.npz")["tokens"]
    np.testing.assert_array_equal(
        zoo.predict(quantized, tokens),
        zoo.predict(dataclasses.replace(loaded, model=plain), tokens),
    )
    # ... and nearly the checkpoint's model: within what quantization changes
    reference = zoo.predict(loaded, tokens)
    difference = np.abs(zoo.predict(quantized, tokens) - reference).max()
    assert 0 < difference < {"int8": 0.05, "int4": 0.5, "nf4": 0.5}[qtype] * np.abs(reference).max()


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A QLoRA (nf4) fine-tune of the Qwen 3 fixture, and its workdir."""
    workdir = tmp_path_factory.mktemp("qlora")
    result = zoo.finetune(
        QWEN, *TUNE, f"workdir={workdir}", lora_rank=4, lora_layers="layers", quantize="nf4"
    )
    return result, workdir


def test_a_fine_tune_trains_the_adapters_alone_over_the_quantized_checkpoint(tuned, qwen):
    (result, _), pretrained = tuned, qwen
    assert result.config.finetune.quantize == "nf4"
    checkpoint = kernels(pretrained.model)
    found = adapters(result.model)
    assert len(found) == 14  # q, k, v, o, gate, up, down in each of 2 layers
    for path, adapter in found.items():
        assert adapter.base_module.kernel is None, path  # the float kernel is not kept
        assert adapter.codes[...].dtype == jnp.uint8, path
        # the codes are the checkpoint's kernel quantized, bit for bit, after 3 steps
        codes, scale = quantize(jnp.asarray(checkpoint[path]), adapter.layout)
        np.testing.assert_array_equal(np.asarray(adapter.codes[...]), np.asarray(codes), path)
        np.testing.assert_array_equal(np.asarray(adapter.scale[...]), np.asarray(scale), path)
        assert np.abs(np.asarray(adapter.lora_b[...])).max() > 0, path  # trained
    params = nnx.to_flat_state(nnx.state(result.model, nnx.Not(nnx.LoRAParam)))
    original = dict(nnx.to_flat_state(nnx.state(pretrained.model, nnx.Param)))
    for path, value in params:
        if isinstance(value, nnx.Param):  # norms, embedding: untouched
            key = tuple(p for p in path if p != "base_module")
            np.testing.assert_array_equal(value[...], original[key][...], err_msg=str(path))


def test_merge_and_export_give_the_dequantized_kernel_plus_the_adapter(tuned, qwen, tmp_path):
    (_, workdir), pretrained = tuned, qwen
    loaded = zoo.load(workdir)  # rebuilt from the run's config, codes and adapters restored
    tokens = np.load(QWEN / "reference.npz")["tokens"]
    expected = {}
    with loaded.activate():
        for path, adapter in adapters(loaded.model).items():
            a, b = np.asarray(adapter.lora_a[...]), np.asarray(adapter.lora_b[...])
            base = np.asarray(adapter.base_kernel())
            delta = np.tensordot(a, b, axes=(-1, 0))  # (inputs..., outputs...)
            inputs = a.ndim - 1
            expected[path] = base + np.moveaxis(
                delta, range(inputs), range(delta.ndim - inputs, delta.ndim)
            )
    merged = zoo.merge_lora(loaded)
    np.testing.assert_allclose(
        zoo.predict(merged, tokens), zoo.predict(loaded, tokens), atol=1e-5, rtol=0
    )
    merged_kernels = kernels(merged.model)
    assert merged_kernels.keys() == expected.keys()
    for path, kernel in expected.items():
        assert merged_kernels[path].dtype == np.float32, path  # the checkpoint's dtype
        np.testing.assert_allclose(merged_kernels[path], kernel, atol=1e-6, rtol=0, err_msg=path)
    exported = zoo.export(workdir, tmp_path / "hf", format="hf")
    reread = kernels(zoo.load(exported).model)  # zoo's own reader of the checkpoint layout
    for path, kernel in merged_kernels.items():
        np.testing.assert_array_equal(reread[path], kernel, err_msg=path)
    assert kernels(pretrained.model).keys() == reread.keys()


def test_quantize_is_refused_without_adapters_or_for_an_unknown_format(tmp_path):
    with pytest.raises(ZooError, match=r"quantize=nf4 .* lora_rank=0 adds none"):
        zoo.finetune(QWEN, *TUNE, f"workdir={tmp_path}", quantize="nf4")
    with pytest.raises(ZooError, match=r"quantize=fp4 is not a base-weight format: .*int8"):
        zoo.finetune(QWEN, *TUNE, f"workdir={tmp_path}", lora_rank=4, quantize="fp4")
    assert not any(tmp_path.iterdir())  # refused before anything was written
    cli = run_cli(
        f"finetune.init_from={QWEN}", *TUNE, f"workdir={tmp_path}", "finetune.quantize=int4"
    )
    assert cli.returncode != 0
    assert "finetune.quantize=int4 quantizes the base weights" in cli.stderr, cli.stderr


def test_lora_on_scanned_layers_stacks_the_adapters_and_merges_and_exports_each_layer(tmp_path):
    """`model.scan_layers=true`: each adapter holds every layer's, stacked as the kernels are,
    and the scan hands each step its layer's; the merge folds each layer's into its kernel."""
    scan = ("model.scan_layers=true", f"workdir={tmp_path / 'run'}")
    tuned = zoo.finetune(QWEN, *TUNE, *scan, lora_rank=4, lora_layers="layers")
    found = adapters(tuned.model)
    assert len(found) == 7  # q, k, v, o, gate, up, down: one adapter for both layers
    query = found["layers.attention.query"]
    assert query.lora_a.shape == (2, 32, 4) and query.lora_b.shape == (2, 4, 4, 16)
    for adapter in found.values():  # both layers' adapters trained, each its own
        b = np.asarray(adapter.lora_b[...])
        assert np.abs(b[0]).max() > 0 and np.abs(b[1]).max() > 0 and not np.allclose(b[0], b[1])
    tokens = np.load(QWEN / "reference.npz")["tokens"]
    adapted = zoo.predict(tuned, tokens)
    merged = zoo.merge_lora(tuned)
    np.testing.assert_allclose(zoo.predict(merged, tokens), adapted, atol=1e-5, rtol=0)
    exported = zoo.export(tmp_path / "run", tmp_path / "hf", format="hf")
    unscanned = zoo.load(exported)  # the checkpoint's layout, read a layer at a time
    assert not unscanned.config.model.scan_layers
    np.testing.assert_allclose(zoo.predict(unscanned, tokens), adapted, atol=1e-5, rtol=0)


def test_qlora_is_refused_for_layers_stacked_for_scanning(tmp_path):
    with pytest.raises(ZooError, match=r"quantize=nf4 holds .* model.scan_layers=false"):
        zoo.finetune(
            QWEN,
            *TUNE,
            "model.scan_layers=true",
            f"workdir={tmp_path}",
            lora_rank=4,
            quantize="nf4",
        )
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_a_qlora_fine_tune_of_a_zoo_run_quantizes_that_run_s_kernels(tmp_path):
    small = (
        "model.dim=64",
        "model.depth=2",
        "model.num_heads=4",
        "model.context_length=32",
        "data.window=32",
        "data.eval_bytes=4096",
        "trainer.batch_size=8",
        "trainer.steps=2",
        "trainer.eval_every=0",
        "optimizer.warmup_steps=0",
    )
    base = zoo.finetune("decoder", *small, f"workdir={tmp_path / 'base'}")
    tuned = zoo.finetune(
        tmp_path / "base",
        *small,
        f"workdir={tmp_path / 'qlora'}",
        lora_rank=4,
        lora_layers="layers",
        quantize="int4",
    )
    trained = kernels(base.model)
    found = adapters(tuned.model)
    assert found.keys() == trained.keys()
    for path, adapter in found.items():
        codes, scale = quantize(jnp.asarray(trained[path]), adapter.layout)
        np.testing.assert_array_equal(np.asarray(adapter.codes[...]), np.asarray(codes), path)
        np.testing.assert_array_equal(np.asarray(adapter.scale[...]), np.asarray(scale), path)

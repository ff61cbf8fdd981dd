"""Fine-tuning a pretrained ViT and ResNet directory on a data set of other images, the way a
user does (`zoo.finetune(DIR, data=..., replace_head=True)` for the ViT, the command line for the
ResNet; the data set deciding the input shape and classes), and exporting the fine-tuned runs:
`hf` loads back bit for bit, `jax` is called and matches `zoo.predict`."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import ROOT, run_cli
from safetensors.numpy import load_file
from zoo.engine.weights import pretrained as weights

import zoo

FIXTURES = ROOT / "tests" / "fixtures" / "pretrained"
SHORT = (
    "data.normalize=false",
    "trainer.steps=2",
    "trainer.batch_size=16",
    "trainer.eval_every=2",
    "optimizer.warmup_steps=0",
    "optimizer.learning_rate=1e-4",
)


def finetuned(directory, workdir) -> zoo.RunResult:
    """Two steps on 8x8 grayscale digits (10 classes) from a 3-channel checkpoint."""
    return zoo.finetune(directory, *SHORT, f"workdir={workdir}", data="digits", replace_head=True)


@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    return finetuned(FIXTURES / "vit-hf", tmp_path_factory.mktemp("vit"))


@pytest.fixture(scope="module")
def resnet(tmp_path_factory) -> Path:
    """The workdir of the same fine-tune of a ResNet directory, from the command line:
    `python -m zoo.train finetune.init_from=DIR data=digits finetune.reinit=[head]`."""
    workdir = tmp_path_factory.mktemp("resnet")
    start = FIXTURES / "resnet18-timm"
    reinit = "finetune.reinit=[head]"
    result = run_cli(
        f"finetune.init_from={start}", "data=digits", reinit, *SHORT, f"workdir={workdir}"
    )
    assert result.returncode == 0, result.stderr
    return workdir


def params(directory) -> dict:
    state = nnx.state(zoo.load(directory).model, (nnx.Param, nnx.BatchStat))
    return {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(state)}


def digits() -> np.ndarray:
    return np.random.default_rng(0).uniform(0, 16, (3, 8, 8, 1)).astype(np.float32)


def test_a_vit_directory_fine_tunes_on_digits_the_data_set_deciding_its_shape(vit):
    """The 3-channel patch embedding summed for 1-channel 8x8 digits, the checkpoint's 3x3
    positions resized to 2x2 patches, a fresh 10-class head; no `model.*` key given."""
    assert vit.step == 2 and np.isfinite(vit.eval_metrics["loss"])
    model = zoo.load(vit.workdir).model
    assert model.head.kernel.shape == (16, 10) and model.embed.kernel.shape == (4, 4, 1, 16)
    start = load_file(FIXTURES / "vit-hf" / "model.safetensors")
    summed = start["vit.embeddings.patch_embeddings.projection.weight"].sum(axis=1)
    assert (
        np.abs(np.asarray(model.embed.kernel[...])[..., 0, :] - summed.transpose(1, 2, 0)).max()
        < 1e-2
    )
    started = start["vit.encoder.layer.0.layernorm_before.bias"]
    moved = np.abs(np.asarray(model.blocks[0].attention_norm.bias[...]) - started).max()
    assert 0 < moved < 1e-2  # two small steps from the checkpoint's values


def test_a_resnet_directory_fine_tunes_on_digits_the_data_set_deciding_its_shape(resnet):
    assert "Final eval @ step 2: accuracy" in (resnet / "train.log").read_text()
    trained = zoo.load(resnet)
    assert trained.model.head.kernel.shape[-1] == 10
    stem = load_file(FIXTURES / "resnet18-timm" / "model.safetensors")["conv1.weight"]
    kernel = np.asarray(trained.model.stem.kernel[...])
    assert kernel.shape[2] == 1
    assert np.abs(kernel[:, :, 0, :] - stem.sum(axis=1).transpose(1, 2, 0)).max() < 1e-2


@pytest.mark.parametrize("name", ["vit", "resnet"])
def test_hf_export_of_a_fine_tuned_run_loads_back_bit_identical(name, request, tmp_path):
    run = request.getfixturevalue(name)
    run = run if name == "resnet" else run.workdir
    out = zoo.export(run, tmp_path / "hf", format="hf")
    assert weights.open_pretrained(out).family.model == name
    before, after = params(run), params(out)
    assert before.keys() == after.keys()
    if name == "vit":  # held at the digits' 2x2 patches, as the run computes with them
        trained = zoo.load(run)
        with trained.activate():
            before[("positions",)] = np.asarray(trained.model._positions((2, 2)))
        assert json.loads((tmp_path / "hf" / "config.json").read_text())["image_size"] == 8
    for path in before:
        np.testing.assert_array_equal(before[path], after[path], err_msg=str(path))
    images = np.resize(digits(), (8, *digits().shape[1:]))  # a batch the 8 devices split
    np.testing.assert_allclose(
        zoo.predict(zoo.load(out), images), zoo.predict(zoo.load(run), images), rtol=1e-5, atol=1e-6
    )


def test_exported_vit_gives_the_runs_logits_in_transformers(vit, tmp_path):
    pytest.importorskip("transformers")
    import torch
    from transformers import ViTForImageClassification

    out = zoo.export(vit.workdir, tmp_path / "hf", format="hf")
    reference = ViTForImageClassification.from_pretrained(out).eval()
    images = digits()
    normalised = (images - 0.5) / 0.5  # the checkpoint's pixel statistics, applied by zoo's model
    with torch.no_grad():
        pixels = torch.from_numpy(normalised.transpose(0, 3, 1, 2).copy())
        live = reference(pixel_values=pixels).logits.numpy()
    with jax.default_matmul_precision("highest"):
        expected = zoo.predict(zoo.load(vit.workdir, devices=jax.devices()[:1]), images)
    np.testing.assert_allclose(live, expected, atol=1e-5, rtol=0)


def test_ema_weights_are_refused_for_a_run_without_an_average(resnet, tmp_path):
    with pytest.raises(zoo.ZooError, match="weights='ema' needs a run trained with optimizer"):
        zoo.export(resnet, tmp_path / "hf", format="hf", weights="ema")
    assert not (tmp_path / "hf").exists()


def test_jax_export_of_a_fine_tuned_vit_matches_predict(vit, tmp_path):
    out = zoo.export(vit.workdir, tmp_path / "jax", format="jax")
    with open(f"{out}/model.jaxexport", "rb") as f:
        function = jax.export.deserialize(bytearray(f.read()))
    with np.load(f"{out}/weights.npz") as npz:
        leaves = [npz[name] for name in sorted(npz.files)]
    images = digits()[:1]
    np.testing.assert_allclose(
        np.asarray(function.call(leaves, images)),
        zoo.predict(zoo.load(vit.workdir), images),
        atol=1e-5,
        rtol=0,
    )

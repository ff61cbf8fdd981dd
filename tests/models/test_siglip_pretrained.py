"""vit's SigLIP classifier checkpoints (`hf-siglip-vision`: transformers'
`SiglipForImageClassification`): logits within 1e-5 of transformers' on one device and the
2x2x2 mesh, at the checkpoint's image size and at a larger one (positions resized as
`interpolate_pos_encoding` does); the options read from config.json; the settings and SigLIP
checkpoints it does not build refused by name; a fine-tune of the checkpoint exported and read
back."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pretrained_checks as checks
import pytest
from conformance.checks import MESH, ONE_DEVICE
from pretrained_checks import FIXTURES, exported, loaded, logits, reference, script
from zoo.engine.weights import pretrained as weights

import zoo

NAME = "siglip-vision-tiny"


@pytest.mark.parametrize("mesh", [ONE_DEVICE, MESH], ids=["one-device", "mesh"])
@pytest.mark.parametrize("size", ["", "large_"])
def test_logits_are_transformers(mesh, size):
    expected = reference(NAME)
    images = expected[f"{size}images"]
    model, _ = loaded(FIXTURES / NAME, mesh, input_shape=list(images.shape[1:]))
    out = logits(model, images, mesh)
    np.testing.assert_allclose(out, expected[f"{size}logits"], rtol=0, atol=1e-5)


def test_the_options_come_from_config_json():
    hparams = weights.open_pretrained(FIXTURES / NAME).hparams()
    assert {k: hparams[k] for k in ("class_token", "pool", "norm_after_pool", "exact_gelu")} == {
        "class_token": False,
        "pool": "mean",
        "norm_after_pool": False,
        "exact_gelu": False,
    }
    assert (hparams["mlp_dim"], hparams["norm_epsilon"], hparams["num_classes"]) == (48, 1e-6, 3)
    assert hparams["position_grid"] == [4, 4] and hparams["pixel_mean"] == [0.5] * 3


def changed(tmp_path, **changes):
    """A copy of the fixture whose config.json has `changes` (a dict value for `vision_config`
    updates its keys)."""
    directory = tmp_path / NAME
    shutil.copytree(FIXTURES / NAME, directory)
    config = json.loads((directory / "config.json").read_text())
    vision = changes.pop("vision_config", {})
    config.update(changes)
    config["vision_config"].update(vision)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"vision_config": {"hidden_act": "relu"}}, "vision_config.hidden_act='relu'"),
        ({"vision_config": {"image_size": [16, 24]}}, r"vision_config.image_size=\[16, 24\]"),
        ({"model_type": "siglip2"}, "model_type='siglip2'"),
        ({"architectures": ["SiglipVisionModel"]}, r"architectures=\['SiglipVisionModel'\]"),
    ],
)
def test_what_vit_does_not_build_is_refused_by_name(tmp_path, changes, named):
    directory = changed(tmp_path, **changes)
    with pytest.raises(zoo.ZooError, match=named):
        zoo.load(directory, devices=jax.devices()[:1])


def test_the_unused_attention_pooling_head_is_not_loaded_nor_exported(tmp_path):
    model, hparams = loaded(FIXTURES / NAME)
    family = weights.open_pretrained(FIXTURES / NAME).family
    out = exported(model, hparams, family, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["vision_config"]["vision_use_head"] is False
    assert config["vision_config"]["intermediate_size"] == 48
    again, _ = loaded(out)
    expected = reference(NAME)
    np.testing.assert_allclose(logits(again, expected["images"]), expected["logits"], atol=1e-5)


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory) -> zoo.RunResult:
    """Two steps on 8x8 grayscale digits (10 classes) from the 3-channel checkpoint."""
    short = ("data.normalize=false", "trainer.steps=2", "trainer.batch_size=16")
    short += ("trainer.eval_every=2", "optimizer.warmup_steps=0")
    workdir = tmp_path_factory.mktemp("siglip")
    return zoo.finetune(
        FIXTURES / NAME, *short, f"workdir={workdir}", data="digits", replace_head=True
    )


def test_it_fine_tunes_and_exports_as_a_vit(finetuned, tmp_path):
    assert finetuned.step == 2 and np.isfinite(finetuned.eval_metrics["loss"])
    out = zoo.export(finetuned.workdir, tmp_path / "hf", format="hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["SiglipForImageClassification"]
    assert config["vision_config"]["num_channels"] == 1 and len(config["id2label"]) == 10
    images = np.random.default_rng(0).uniform(0, 16, (3, 8, 8, 1)).astype(np.float32)
    one = jax.devices()[:1]
    with jax.default_matmul_precision("highest"):
        run = zoo.predict(zoo.load(finetuned.workdir, devices=one), images)
        back = zoo.predict(zoo.load(out, devices=one), images)
    np.testing.assert_allclose(back, run, rtol=0, atol=1e-5)


@checks.needs_reference
def test_the_export_loads_in_transformers_with_the_same_logits(tmp_path):
    from transformers import SiglipForImageClassification

    make_siglip = script("make_siglip")
    model, hparams = loaded(FIXTURES / NAME)
    family = weights.open_pretrained(FIXTURES / NAME).family
    module = SiglipForImageClassification.from_pretrained(
        exported(model, hparams, family, tmp_path / "out")
    )
    expected = reference(NAME)
    again = make_siglip.logits(module.eval(), expected["images"])
    np.testing.assert_allclose(again, expected["logits"], rtol=0, atol=1e-5)


@checks.needs_reference
def test_the_references_regenerate_live(tmp_path):
    checks.assert_references_regenerate("make_siglip", [NAME], tmp_path)

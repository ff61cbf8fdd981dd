"""vit's Hugging Face- and timm-layout ViT checkpoints (each family's parity on its fixtures, on
one device and the 2x2x2 mesh, and its export: tests/conformance/): at a larger image size than
the checkpoint's, positions resized as each family's code does; the options read from
config.json; the faults refused; the exports read by the reference code."""

from __future__ import annotations

import numpy as np
import pretrained_checks as checks
import pytest
from pretrained_checks import FIXTURES, exported, loaded, logits, reference, script
from zoo.engine.weights import pretrained as weights

import zoo

CHECKPOINTS = ["vit-hf", "vit-timm-token", "vit-timm-avg"]


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_larger_images_resize_the_positions_as_the_reference_does(name):
    expected = reference(name)
    side = expected["large_images"].shape[1]
    model, hparams = loaded(FIXTURES / name, input_shape=[side, side, 3])
    assert hparams["position_grid"] == [3, 3]
    out = logits(model, expected["large_images"])
    np.testing.assert_allclose(out, expected["large_logits"], rtol=0, atol=1e-5)


def test_the_families_options_come_from_config_json():
    options = ("class_token", "pool", "norm_after_pool", "norm_epsilon", "position_resize")
    found = {
        name: tuple(weights.open_pretrained(FIXTURES / name).hparams()[k] for k in options)
        for name in CHECKPOINTS
    }
    assert found == {
        "vit-hf": (True, "cls", False, 1e-12, "bicubic"),
        "vit-timm-token": (True, "cls", False, 1e-6, "bicubic_antialias"),
        "vit-timm-avg": (False, "mean", True, 1e-6, "bicubic_antialias"),
    }


def test_a_head_of_another_size_is_refused_by_name():
    with pytest.raises(zoo.ZooError, match=r"head\.kernel \(from classifier\.weight"):
        loaded(FIXTURES / "vit-hf", num_classes=3)


def test_a_directory_of_another_family_is_refused():
    with pytest.raises(zoo.ZooError, match="no registered family of model 'vit'"):
        weights.open_pretrained(FIXTURES / "resnet-hf-basic", model="vit")


@checks.needs_reference
def test_the_exported_directories_load_in_the_reference_code(tmp_path):
    make_vit = script("make_vit")
    from transformers import ViTForImageClassification

    for name in CHECKPOINTS:
        model, hparams = loaded(FIXTURES / name)
        family = weights.open_pretrained(FIXTURES / name).family
        out = exported(model, hparams, family, tmp_path / name)
        if name == "vit-hf":
            module, mean = ViTForImageClassification.from_pretrained(out), make_vit.HALF
            std = mean
        else:
            module = make_vit.timm_reference(tmp_path / name)
            mean, std = make_vit.IMAGENET_MEAN, make_vit.IMAGENET_STD
        expected = reference(name)
        again = make_vit.logits(module.eval(), expected["images"], mean, std)
        np.testing.assert_allclose(again, expected["logits"], rtol=0, atol=1e-5)


@checks.needs_reference
def test_the_references_regenerate_live(tmp_path):
    checks.assert_references_regenerate("make_vit", CHECKPOINTS, tmp_path)

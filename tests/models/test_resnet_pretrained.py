"""resnet's torchvision/timm- and Hugging Face-layout ResNet checkpoints (each family's parity
on its fixtures, on one device and the 2x2x2 mesh, and its export: tests/conformance/): the
configs they are recognised by and the sizes they imply, a 3-channel stem adapted to grayscale
input as timm does, the faults refused, and the exports read by the reference code."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pretrained_checks as checks
import pytest
from pretrained_checks import FIXTURES, exported, loaded, logits, reference, script
from zoo.engine.weights import pretrained as weights

import zoo

CHECKPOINTS = ["resnet18-timm", "resnet50-timm", "resnet-hf-basic", "resnet-hf-bottleneck"]


def test_families_are_recognised_by_their_config():
    assert weights.open_pretrained(FIXTURES / "resnet50-timm").family.name == "timm-resnet"
    assert weights.open_pretrained(FIXTURES / "resnet-hf-basic").family.name == "hf-resnet"
    for name in CHECKPOINTS:  # the ImageNet stem, padded on both sides as torch pads
        hparams = weights.open_pretrained(FIXTURES / name).hparams()
        assert hparams["stem"] == "imagenet" and hparams["padding"] == "symmetric", name
    hparams = weights.open_pretrained(FIXTURES / "resnet50-timm").hparams()
    assert (hparams["block"], hparams["stage_sizes"], hparams["width"]) == (
        "bottleneck",
        [3, 4, 6, 3],
        4,
    )


def test_a_grayscale_model_sums_the_stem_over_input_channels():
    expected = reference("resnet18-timm")
    model, _ = loaded(FIXTURES / "resnet18-timm", input_shape=[40, 40, 1])
    assert model.stem.kernel.shape == (7, 7, 1, 4)
    out = logits(model, expected["gray_images"])
    np.testing.assert_allclose(out, expected["gray_logits"], rtol=0, atol=1e-5)


def test_a_directory_of_another_family_is_refused():
    with pytest.raises(zoo.ZooError, match="no registered family of model 'gpt'"):
        weights.open_pretrained(FIXTURES / "resnet-hf-basic", model="gpt")
    with pytest.raises(zoo.ZooError, match="no registered family of model 'resnet'"):
        weights.open_pretrained(FIXTURES / "gpt2-tiny", model="resnet")


def test_a_head_of_another_size_is_refused_by_name():
    with pytest.raises(zoo.ZooError, match=r"head\.kernel \(from fc\.weight: \(32, 5\)"):
        loaded(FIXTURES / "resnet18-timm", num_classes=7)


def test_an_unusual_hugging_face_resnet_is_refused(tmp_path):
    directory = tmp_path / "odd"
    shutil.copytree(FIXTURES / "resnet-hf-basic", directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "downsample_in_bottleneck": True}))
    with pytest.raises(zoo.ZooError, match="downsample_in_bottleneck"):
        weights.open_pretrained(directory).hparams()


@checks.needs_reference
def test_the_exported_directories_load_in_the_reference_code(tmp_path):
    make_resnet = script("make_resnet")
    from transformers import ResNetForImageClassification

    for name in ("resnet18-timm", "resnet-hf-bottleneck"):
        model, hparams = loaded(FIXTURES / name)
        family = weights.open_pretrained(FIXTURES / name).family
        out = exported(model, hparams, family, tmp_path / name)
        expected = reference(name)
        if family.name == "hf-resnet":
            module = ResNetForImageClassification.from_pretrained(out).eval()
        else:
            module = make_resnet.torchvision_reference(tmp_path / name)
        mean, std = make_resnet.IMAGENET_MEAN, make_resnet.IMAGENET_STD
        again = make_resnet.logits(module, expected["images"], mean, std)
        np.testing.assert_allclose(again, expected["logits"], rtol=0, atol=1e-5)


@checks.needs_reference
def test_the_references_regenerate_live(tmp_path):
    checks.assert_references_regenerate("make_resnet", CHECKPOINTS, tmp_path)

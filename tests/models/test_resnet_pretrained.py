"""resnet loads torchvision/timm- and Hugging Face-layout ResNet checkpoints exactly (logits of
the reference at 1e-5 in float32, on one device and the (2, 2, 2) mesh), adapts a 3-channel
stem to grayscale input as timm does, and writes the same layouts back."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pretrained_checks as checks
import pytest
from model_checks import MESH, ONE_DEVICE
from pretrained_checks import FIXTURES, exported, loaded, logits, reference, script
from zoo.engine import weights

import zoo

CHECKPOINTS = ["resnet18-timm", "resnet50-timm", "resnet-hf-basic", "resnet-hf-bottleneck"]


@pytest.mark.parametrize("mesh", [ONE_DEVICE, MESH], ids=["one_device", "mesh"])
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_logits_match_the_reference(name, mesh):
    hparams = checks.assert_logits_match_the_reference(name, mesh)
    assert hparams["stem"] == "imagenet" and hparams["padding"] == "symmetric"


def test_families_are_recognised_by_their_config():
    assert weights.open_pretrained(FIXTURES / "resnet50-timm").family.name == "timm-resnet"
    assert weights.open_pretrained(FIXTURES / "resnet-hf-basic").family.name == "hf-resnet"
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


@pytest.mark.parametrize("name", ["resnet50-timm", "resnet-hf-basic"])
def test_export_writes_back_the_checkpoint_and_reloads_bit_identical(name, tmp_path):
    checks.assert_export_round_trip(name, tmp_path / "out")


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

"""Every setting of a checkpoint's config accounted for: each key of every fixture's
`config.json` (and `preprocessor_config.json`) is honoured or inert for its family; a setting
zoo does not build is refused by name before anything is built, and a key it has never heard of
is named in one warning. The settings that once loaded silently wrong: GPT-2's attention scale
options give transformers' logits (and not those without the option), a ViT's image-processor
statistics normalise its inputs, a Hugging Face ResNet takes any image size, and a GPT-2's
predictions have one column per token of its vocabulary."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from conformance.checks import tiny_models
from helpers import ROOT
from zoo.engine import registry
from zoo.engine.sharding import mesh as sharding
from zoo.engine.weights import pretrained as weights

import zoo
from zoo.loading import checkpoint_hparams, plan_pretrained

FIXTURES = ROOT / "tests" / "fixtures" / "pretrained"
ONE = jax.devices()[:1]
ZOO_FAMILIES = [f for name in tiny_models() for f in registry.families(name)]


def fixture_configs() -> list[Path]:
    return sorted(p for p in FIXTURES.iterdir() if (p / "config.json").is_file())


def copy_with(tmp_path: Path, name: str, file: str = "config.json", **changes) -> Path:
    """A copy of fixture `name` whose `file` has `changes` (None: the key removed)."""
    directory = tmp_path / name
    shutil.copytree(FIXTURES / name, directory)
    path = directory / file
    content = json.loads(path.read_text()) if path.is_file() else {}
    content.update(changes)
    path.write_text(json.dumps({k: v for k, v in content.items() if v is not None}))
    return directory


def reference(directory: Path) -> tuple[np.ndarray, np.ndarray]:
    with np.load(directory / "reference.npz") as npz:
        (inputs,) = [key for key in npz if key != "logits" and "_" not in key]
        return npz[inputs], npz["logits"]


def predicted(directory: Path, inputs: np.ndarray) -> np.ndarray:
    with jax.default_matmul_precision("highest"):
        return zoo.predict(zoo.load(directory, devices=ONE), inputs)


@pytest.mark.parametrize("family", ZOO_FAMILIES, ids=lambda f: f.name)
def test_each_family_of_zoo_lists_the_keys_it_honours(family):
    assert family.honoured, f"{family.name} lists no config keys it honours"


@pytest.mark.parametrize("directory", fixture_configs(), ids=lambda p: p.name)
def test_every_key_of_every_fixture_is_honoured_or_inert(directory):
    pretrained = weights.open_pretrained(directory)
    assert pretrained.family.unaccounted(pretrained.config) == {}


@pytest.mark.parametrize(
    "name, option, without",
    [
        ("gpt2-tiny-unscaled", "scale_attention", {"scale_attention": True}),
        (
            "gpt2-tiny-scaled-by-layer",
            "scale_attention_by_layer",
            {"scale_attention_by_layer": False},
        ),
    ],
)
def test_gpt2_attention_scale_options_give_transformers_logits(name, option, without):
    directory = FIXTURES / name
    tokens, logits = reference(directory)
    np.testing.assert_allclose(predicted(directory, tokens), logits, atol=1e-5, rtol=0)
    pretrained = weights.open_pretrained(directory)
    hparams = checkpoint_hparams(pretrained)
    assert hparams[option] != without[option]
    planned = plan_pretrained(pretrained, {**hparams, **without}, None, ONE)
    model = planned.fill()
    with sharding.activate(planned.mesh, planned.rules), jax.default_matmul_precision("highest"):
        ignored = np.asarray(model(tokens))[..., : logits.shape[-1]]
    assert np.abs(ignored - logits).max() > 1e-2  # the option matters at this tolerance


@pytest.mark.parametrize("name", ["gpt2-tiny-unscaled", "gpt2-tiny-scaled-by-layer"])
def test_gpt2_attention_scale_options_hold_in_stacked_layers(name):
    """Each layer of the stack (`scan_layers`) takes its own scale as a scanned input."""
    tokens, logits = reference(FIXTURES / name)
    pretrained = weights.open_pretrained(FIXTURES / name)
    hparams = {**checkpoint_hparams(pretrained), "scan_layers": True}
    planned = plan_pretrained(pretrained, hparams, None, ONE)
    model = planned.fill()
    with sharding.activate(planned.mesh, planned.rules), jax.default_matmul_precision("highest"):
        out = np.asarray(model(tokens))[..., : logits.shape[-1]]
    np.testing.assert_allclose(out, logits, atol=1e-5, rtol=0)


def test_gpt2_predictions_have_a_column_per_token_of_the_vocabulary():
    tokens, logits = reference(FIXTURES / "gpt2-tiny")
    out = predicted(FIXTURES / "gpt2-tiny", tokens)
    assert out.shape == logits.shape == (*tokens.shape, 300)
    assert np.isfinite(out).all()


def test_a_vit_is_normalised_with_its_image_processors_statistics():
    directory = FIXTURES / "vit-hf-imagenet"
    assert checkpoint_hparams(weights.open_pretrained(directory))["pixel_std"] == [
        0.229,
        0.224,
        0.225,
    ]
    images, logits = reference(directory)
    np.testing.assert_allclose(predicted(directory, images), logits, atol=1e-5, rtol=0)


def test_the_image_processors_rescaling_is_folded_into_the_statistics(tmp_path):
    """Pixels not rescaled (0-255) and normalised with 127.5 are vit-hf's 0.5 and 0.5."""
    processor = {"do_rescale": False, "image_mean": 127.5, "image_std": [127.5] * 3}
    directory = copy_with(tmp_path, "vit-hf", "preprocessor_config.json", **processor)
    hparams = checkpoint_hparams(weights.open_pretrained(directory))
    assert hparams["pixel_mean"] == hparams["pixel_std"] == [0.5] * 3
    images, logits = reference(FIXTURES / "vit-hf")
    np.testing.assert_allclose(predicted(directory, images), logits, atol=1e-5, rtol=0)


def test_a_statistic_of_the_wrong_length_is_refused(tmp_path):
    directory = copy_with(tmp_path, "vit-hf", "preprocessor_config.json", image_mean=[0.5, 0.5])
    with pytest.raises(zoo.ZooError, match=r"image_mean=\[0.5, 0.5\].*3-channel"):
        checkpoint_hparams(weights.open_pretrained(directory))


def test_a_hugging_face_resnet_takes_images_of_any_size():
    directory = FIXTURES / "resnet-hf-basic"
    trained = zoo.load(directory, devices=ONE)
    assert list(trained.config.model.input_shape) == [224, 224, 3]
    images, logits = reference(directory)  # 40 x 40
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(zoo.predict(trained, images), logits, atol=1e-5, rtol=0)
    wide = np.random.default_rng(0).uniform(0, 1, (3, 24, 56, 3)).astype(np.float32)
    assert zoo.predict(trained, wide).shape == (3, 5)


@pytest.mark.parametrize(
    "name, changes, named",
    [
        ("gpt2-tiny", {"tie_word_embeddings": False}, "tie_word_embeddings=false"),
        ("gpt2-tiny", {"pruned_heads": {"0": [1]}}, r"pruned_heads=\{'0': \[1\]\}"),
        ("gpt2-tiny", {"add_cross_attention": True}, "add_cross_attention=True"),
        ("resnet18-timm", {"global_pool": "max"}, "global_pool='max'"),
        ("vit-hf", {"qkv_bias": False}, "qkv_bias=False"),
        (
            "qwen3-moe-tiny",
            {"quantization_config": {"quant_method": "mxfp4"}},
            r"quant_method='mxfp4'\); decoder loads qwen3_moe checkpoints in float32",
        ),
        (
            "gpt-oss-tiny",
            {"quantization_config": {"quant_method": "bitsandbytes_4bit"}},
            r"quant_method='bitsandbytes_4bit'.*or, quantized, with quant_method 'mxfp4'",
        ),
        (
            "gpt-oss-tiny",
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
            "rope_type 'yarn' but no original_max_position_embeddings",
        ),
        ("gpt-oss-tiny", {"layer_types": ["full_attention"]}, "num_hidden_layers=3"),
        (
            "deepseek-v3-tiny",
            {"num_key_value_heads": 2},
            "num_key_value_heads=2 and num_attention_heads=4",
        ),
        ("deepseek-v3-tiny", {"attention_bias": True}, "attention_bias=true"),
        ("deepseek-v3-tiny", {"scoring_func": "softmax"}, "scoring_func='softmax'"),
        ("deepseek-v3-tiny", {"topk_group": 3, "n_group": 3}, "model.router_groups=3 must split"),
    ],
)
def test_a_setting_zoo_does_not_build_is_refused_by_name(tmp_path, name, changes, named):
    directory = copy_with(tmp_path, name, **changes)
    with pytest.raises(zoo.ZooError, match=named):
        zoo.load(directory, devices=ONE)


def test_an_unknown_key_is_named_in_one_warning(tmp_path, caplog):
    directory = copy_with(tmp_path, "gpt2-tiny", rotary_dim=16)
    with caplog.at_level(logging.WARNING, logger="zoo"):
        trained = zoo.load(directory, devices=ONE)
    warned = [r.getMessage() for r in caplog.records if "does not know" in r.getMessage()]
    assert len(warned) == 1 and "rotary_dim=16" in warned[0], warned
    assert "may change what the model computes" in warned[0]
    tokens, logits = reference(FIXTURES / "gpt2-tiny")
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(zoo.predict(trained, tokens), logits, atol=1e-5, rtol=0)


def test_an_unknown_key_of_a_nested_object_is_named_by_its_path(tmp_path, caplog):
    args = {**json.loads((FIXTURES / "vit-timm-token" / "config.json").read_text())["model_args"]}
    directory = copy_with(tmp_path, "vit-timm-token", model_args={**args, "init_values": 1e-5})
    with caplog.at_level(logging.WARNING, logger="zoo"):
        weights.open_pretrained(directory)
    assert "model_args.init_values=1e-05" in caplog.text

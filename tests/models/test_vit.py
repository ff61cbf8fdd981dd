"""vit: patches -> transformer blocks (attention dropout and branch dropout from call-time
keys) -> mean over tokens -> logits (what every model passes: tests/conformance/)."""

from __future__ import annotations

import numpy as np
import pytest
from conformance.checks import ONE_DEVICE, on_mesh, planned_split, tiny_config
from flax import nnx
from model_checks import Models, digits
from zoo.engine.loop.trainer import Trainer
from zoo.engine.steps import rngs as zoo_rngs

import zoo


@pytest.fixture(scope="module")
def models():
    return Models.tiny("vit", "model.dropout_rate=0.3")


def logits(model, images):
    return model(images)


@nnx.jit
def _call_with_rngs(model, images, rngs):
    return model(images, rngs=rngs)


def test_heads_and_mlp_split_over_tensor():
    assert {"blocks.0.attention.query.kernel", "blocks.1.mlp_in.kernel"} <= planned_split("vit")


def test_vit_draws_fresh_dropout_keys_every_step_and_the_same_on_a_rerun(models):
    model, images = models.fresh(), digits(64)["image"]

    def train_mode_output(seed: int, step: int) -> np.ndarray:
        base = zoo_rngs.step_key(seed)  # the trainer's base key for call-time randomness
        return np.asarray(_call_with_rngs(model, images, zoo_rngs.call_rngs(base, step)))

    with on_mesh(ONE_DEVICE):
        model.train()
        step1, step2 = train_mode_output(0, 1), train_mode_output(0, 2)
        rerun_step1, other_seed_step1 = train_mode_output(0, 1), train_mode_output(1, 1)
        model.eval()
        eval_output = np.asarray(nnx.jit(logits)(model, images))  # no dropout, no keys needed
    assert not np.allclose(step1, step2)  # each step its own masks
    np.testing.assert_array_equal(step1, rerun_step1)  # the same seed and step: the same masks
    assert not np.allclose(step1, other_seed_step1)
    assert not np.allclose(step1, eval_output)


def test_train_mode_with_dropout_needs_call_time_keys(models):
    model = models.fresh()
    model.train()
    with on_mesh(ONE_DEVICE), pytest.raises(zoo.ZooError, match="needs call-time rngs"):
        nnx.jit(logits)(model, digits()["image"])


def test_a_shape_the_model_cannot_take_is_named(tmp_path):
    with pytest.raises(zoo.ZooError, match=r"8x8 images do not split into 3x3 patches"):
        Trainer(tiny_config("vit", "model.patch_size=3", f"workdir={tmp_path}"))
    assert not any(tmp_path.iterdir())  # nothing written


def test_mlp_dim_sets_the_mlp_width_in_place_of_the_ratio():
    model = Models.tiny("vit", "model.mlp_dim=24").fresh()
    assert [block.mlp_in.kernel.shape for block in model.blocks] == [(16, 24)] * 2
    assert Models.tiny("vit").fresh().blocks[0].mlp_in.kernel.shape == (16, 32)


def test_a_negative_mlp_dim_is_named(tmp_path):
    with pytest.raises(zoo.ZooError, match=r"model.mlp_dim=-1 must be a width"):
        Trainer(tiny_config("vit", "model.mlp_dim=-1", f"workdir={tmp_path}"))

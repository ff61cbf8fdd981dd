"""vit: patches -> transformer blocks (attention dropout and branch dropout from call-time
keys) -> mean over tokens -> logits."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from model_checks import (
    ONE_DEVICE,
    Models,
    assert_a_few_steps_lower_the_loss,
    assert_born_sharded_as_planned,
    assert_same_on_one_device_and_the_mesh,
    digits,
    on_mesh,
)
from zoo.engine import rngs as zoo_rngs

import zoo

SMALL = {"patch_size": 2, "dim": 16, "depth": 2, "num_heads": 2}


@pytest.fixture(scope="module")
def models():
    return Models("vit", "digits", dropout_rate=0.3, **SMALL)


def logits(model, images):
    return model(images)


@nnx.jit
def _call_with_rngs(model, images, rngs):
    return model(images, rngs=rngs)


def test_outputs_logits_per_class_on_one_device_and_on_the_mesh(models):
    out = assert_same_on_one_device_and_the_mesh(models, logits, digits()["image"])
    assert out.shape == (16, 10) and np.isfinite(out).all()


def test_heads_and_mlp_split_over_tensor(models):
    split = assert_born_sharded_as_planned(models.split)
    assert {"blocks.0.attention.query.kernel", "blocks.1.mlp_in.kernel"} <= set(split)


def test_a_few_steps_lower_the_loss(models):
    assert_a_few_steps_lower_the_loss(models, digits(64))


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

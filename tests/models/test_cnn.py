"""cnn: conv-BatchNorm-ReLU stages (stride-2 after the first), Dropout, a linear head."""

from __future__ import annotations

import numpy as np
import pytest
from model_checks import (
    Models,
    assert_a_few_steps_lower_the_loss,
    assert_batchnorm_moves_in_train_mode_only,
    assert_born_sharded_as_planned,
    assert_same_on_one_device_and_the_mesh,
    digits,
)


@pytest.fixture(scope="module")
def models():
    return Models("cnn", "digits", channels=[8, 16, 16])


def logits(model, images):
    return model(images)


def test_outputs_logits_per_class_on_one_device_and_on_the_mesh(models):
    out = assert_same_on_one_device_and_the_mesh(models, logits, digits()["image"])
    assert out.shape == (16, 10) and np.isfinite(out).all()


def test_output_channels_split_over_tensor(models):
    split = assert_born_sharded_as_planned(models.split)
    assert {"blocks.0.conv.kernel", "blocks.2.norm.scale"} <= set(split)


def test_a_few_steps_lower_the_loss(models):
    assert_a_few_steps_lower_the_loss(models, digits(64))


def test_batchnorm_normalises_with_batch_statistics_in_train_mode_only(models):
    assert_batchnorm_moves_in_train_mode_only(models, digits()["image"])

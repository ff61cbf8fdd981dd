"""resnet: a small-image ResNet, basic residual blocks with BatchNorm."""

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
    return Models("resnet", "digits", width=8, stage_sizes=[1, 1])


def logits(model, images):
    return model(images)


def test_outputs_logits_per_class_on_one_device_and_on_the_mesh(models):
    out = assert_same_on_one_device_and_the_mesh(models, logits, digits()["image"])
    assert out.shape == (16, 10) and np.isfinite(out).all()


def test_blocks_start_as_the_identity_and_channels_split_over_tensor(models):
    split = assert_born_sharded_as_planned(models.split)
    assert {"stem.kernel", "blocks.1.conv2.kernel", "head.kernel"} <= set(split)
    for block in models.split.blocks:  # the second norm's scale starts at zero
        assert not np.asarray(block.norm2.scale[...]).any()


def test_a_few_steps_lower_the_loss(models):
    assert_a_few_steps_lower_the_loss(models, digits(64), steps=10)


def test_batchnorm_normalises_with_batch_statistics_in_train_mode_only(models):
    assert_batchnorm_moves_in_train_mode_only(models, digits()["image"])

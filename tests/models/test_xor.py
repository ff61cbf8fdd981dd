"""xor: 2 -> 8 tanh -> 1 logit."""

from __future__ import annotations

import numpy as np
import pytest
from model_checks import (
    Models,
    assert_a_few_steps_lower_the_loss,
    assert_born_sharded_as_planned,
    assert_same_on_one_device_and_the_mesh,
)

import zoo

POINTS = zoo.load_data("xor").eval


@pytest.fixture(scope="module")
def models():
    return Models("xor", "xor")


def logits(model, inputs):
    return model(inputs)


def test_outputs_one_logit_per_point_on_one_device_and_on_the_mesh(models):
    out = assert_same_on_one_device_and_the_mesh(models, logits, POINTS["inputs"][:16])
    assert out.shape == (16, 1) and out.dtype == np.float32


def test_hidden_units_split_over_tensor(models):
    split = assert_born_sharded_as_planned(models.split)
    assert set(split) == {"hidden.kernel", "hidden.bias", "output.kernel"}


def test_a_few_steps_lower_the_loss(models):
    batch = {name: column[:64] for name, column in POINTS.items()}
    assert_a_few_steps_lower_the_loss(models, batch, steps=30)

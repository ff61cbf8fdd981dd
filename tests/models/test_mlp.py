"""mlp: flattened image -> hidden ReLU layers with module-bound Dropout -> logits."""

from __future__ import annotations

import jax
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
    outputs,
)


@pytest.fixture(scope="module")
def models():
    return Models("mlp", "digits", hidden_sizes=[32, 32, 32], dropout_rate=0.5)


def logits(model, images):
    return model(images)


def test_outputs_logits_per_class_on_one_device_and_on_the_mesh(models):
    out = assert_same_on_one_device_and_the_mesh(models, logits, digits()["image"])
    assert out.shape == (16, 10) and np.isfinite(out).all()


def test_kernels_alternate_column_and_row_parallel(models):
    split = assert_born_sharded_as_planned(models.split)
    assert {"hidden.0.kernel", "hidden.1.kernel", "hidden.2.kernel"} <= set(split)


def test_a_few_steps_lower_the_loss(models):
    assert_a_few_steps_lower_the_loss(models, digits(64))


def test_dropout_draws_from_its_own_stream_in_train_mode_only(models):
    model, images = models.fresh(), digits()["image"]

    def count():
        return [int(c) for c in jax.tree.leaves(nnx.state(model, nnx.RngCount))]

    model.eval()
    first, again = (outputs(model, ONE_DEVICE, logits, images) for _ in range(2))
    assert count() == [0]
    model.train()
    train_a, train_b = (outputs(model, ONE_DEVICE, logits, images) for _ in range(2))
    np.testing.assert_array_equal(first, again)  # eval: deterministic
    assert not np.allclose(train_a, train_b)  # each call its own masks
    assert count() == [3 * 2]  # one draw per hidden layer per call

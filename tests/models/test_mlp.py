"""mlp: flattened image -> hidden ReLU layers with module-bound Dropout -> logits (what every
model passes: tests/conformance/)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conformance.checks import ONE_DEVICE, planned_split
from flax import nnx
from model_checks import Models, digits, outputs


def logits(model, images):
    return model(images)


def test_kernels_alternate_column_and_row_parallel():
    assert {"hidden.0.kernel", "hidden.1.kernel"} <= planned_split("mlp")


@pytest.fixture(scope="module")
def models():
    return Models.tiny("mlp", "model.dropout_rate=0.5")


def test_dropout_draws_from_its_own_stream_in_train_mode_only(models):
    model, images = models.fresh(), digits()["image"]
    layers = len(models.hparams["hidden_sizes"])

    def count():
        return [int(c) for c in jax.tree.leaves(nnx.state(model, nnx.RngCount))]

    model.eval()
    first, again = (outputs(model, ONE_DEVICE, logits, images) for _ in range(2))
    assert count() == [0]
    model.train()
    train_a, train_b = (outputs(model, ONE_DEVICE, logits, images) for _ in range(2))
    np.testing.assert_array_equal(first, again)  # eval: deterministic
    assert not np.allclose(train_a, train_b)  # each call its own masks
    assert count() == [layers * 2]  # one draw per hidden layer per call

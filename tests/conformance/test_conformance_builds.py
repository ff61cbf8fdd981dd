"""Every model, as its tiny configuration makes it: an abstract build (`zoo.engine.sharding.abstract`:
initialisers not run, alike layers cloned) gives exactly the structure, shapes, dtypes and
sharding annotations that tracing its constructor in full (`nnx.eval_shape`) gives."""

from __future__ import annotations

import pytest
from conformance.checks import (
    PLUGINS,
    assert_abstract_build_equals_the_full_trace,
    tiny_models,
    zoo_models,
)


def test_every_model_of_zoo_and_of_its_plugins_declares_a_tiny_configuration():
    ours = zoo_models(*PLUGINS)
    assert {"cnn", "gpt", "mlp", "resnet", "rings", "vae", "vit", "xor"} <= set(ours)
    assert set(ours) <= set(tiny_models())


@pytest.mark.parametrize("name", tiny_models())
def test_an_abstract_build_equals_the_full_trace(name):
    assert_abstract_build_equals_the_full_trace(name)

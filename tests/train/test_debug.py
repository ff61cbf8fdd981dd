"""`trainer.debug=true`: a model's steps run as plain Python, so print() shows concrete values
inside the model, and the first NaN stops the run at the operation that made it."""

from __future__ import annotations

import traceback

import jax
import jax.numpy as jnp
import pytest
from zoo.models.xor import XorClassifier, binary_classification_loss

import zoo


class Printing(XorClassifier):
    def __call__(self, x: jax.Array) -> jax.Array:
        print("concrete" if not isinstance(x, jax.core.Tracer) else "traced", x.shape)
        return super().__call__(x)


class MakesNaN(XorClassifier):
    def __call__(self, x: jax.Array) -> jax.Array:
        return super().__call__(jnp.log(x - 2.0))  # the inputs lie in [0, 1]: log(negative)


zoo.register_model("debug_printing", Printing, loss=binary_classification_loss, default_data="xor")
zoo.register_model("debug_nan", MakesNaN, loss=binary_classification_loss, default_data="xor")
QUICK = ("trainer.steps=4", "trainer.log_every=2", "trainer.batch_size=32")


def test_debug_runs_the_model_un_jitted(tmp_path, capsys):
    zoo.fit("debug_printing", *QUICK, "trainer.debug=true", f"workdir={tmp_path}/debug")
    printed = capsys.readouterr().out.splitlines()
    # a train step per step, the first step's norms probe, and the eval over 4 batches
    assert printed.count("concrete (32, 2)") >= 4 + 1
    zoo.fit("debug_printing", *QUICK, f"workdir={tmp_path}/jitted")
    assert "concrete (32, 2)" not in capsys.readouterr().out  # jitted: traced once, never run


def test_debug_stops_at_the_operation_that_makes_a_nan(tmp_path):
    with pytest.raises(FloatingPointError) as error:
        zoo.fit("debug_nan", *QUICK, "trainer.debug=true", f"workdir={tmp_path}")
    frames = traceback.extract_tb(error.value.__traceback__)
    assert any(f.name == "__call__" and "jnp.log(x - 2.0)" in (f.line or "") for f in frames)

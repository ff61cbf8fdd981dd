"""A model's constructor draws the same keys whether it runs eagerly, under `nnx.eval_shape` or
inside the jitted init, though its streams count draws on the host (`construction_rngs`)."""

from __future__ import annotations

import itertools

import jax
import pytest
from flax import nnx
from helpers import assert_same_bits
from zoo.engine import registry
from zoo.engine.loop.build import build_model
from zoo.engine.steps import rngs
from zoo.engine.steps.rngs import construction_rngs
from zoo.models import layers

GPT = {
    "vocab_size": 256,
    "context_length": 8,
    "dim": 16,
    "depth": 3,
    "num_heads": 2,
    "mlp_ratio": 2,
    "dropout_rate": 0.1,
}


@pytest.fixture(autouse=True)
def unsharded():
    """No mesh here: models are built unsharded, eagerly and traced alike."""
    with nnx.use_eager_sharding(False):
        yield


def draws(streams: nnx.Rngs) -> list[jax.Array]:
    names = ("params", "dropout")
    return [jax.random.key_data(streams[name]()) for name in names for _ in range(3)]


def test_streams_draw_what_nnx_rngs_draws_eagerly_and_traced():
    keys = {"params": jax.random.key(1), "dropout": jax.random.key(2)}
    expected = draws(nnx.Rngs(**keys))
    assert_same_bits(draws(construction_rngs(**keys)), expected)
    assert_same_bits(jax.jit(lambda k: draws(construction_rngs(**k)))(keys), expected)
    assert len({tuple(k.tolist()) for k in expected}) == len(expected)  # no key drawn twice


def test_a_model_builds_as_with_nnx_rngs_in_the_jitted_init(monkeypatch):
    """Every layer of the gpt draws from construction streams of its own: a draw that read a
    later count under the trace would repeat one layer's weights in the next."""
    entry = registry.get_model("gpt")

    def jitted_init():
        return nnx.jit(lambda: nnx.state(build_model(entry, GPT, seed=3)))()

    built = jitted_init()
    abstract = nnx.eval_shape(lambda: build_model(entry, GPT, seed=3))
    assert jax.tree.structure(nnx.state(abstract)) == jax.tree.structure(built)
    monkeypatch.setattr(layers, "construction_rngs", nnx.Rngs)  # gpt's layer stack
    monkeypatch.setattr(rngs, "construction_rngs", nnx.Rngs)
    assert_same_bits(built, jitted_init())
    kernels = [built["blocks"][i]["mlp_in"]["kernel"][...] for i in range(GPT["depth"])]
    assert all((a != b).any() for a, b in itertools.pairwise(kernels))


def test_a_module_keeps_a_stream_of_device_arrays():
    """Modules keep forks of the construction streams (mlp's dropout), never a host counter."""
    mlp = {"input_shape": [4], "num_classes": 2, "hidden_sizes": [8], "dropout_rate": 0.5}
    model = build_model(registry.get_model("mlp"), mlp, seed=0)
    counts = jax.tree.leaves(nnx.state(model, nnx.RngCount))
    assert counts and all(isinstance(count, jax.Array) for count in counts)

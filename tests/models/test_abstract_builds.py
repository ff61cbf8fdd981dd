"""An abstract build (`zoo.engine.abstract.eval_shape`: initialisers not run, alike layers cloned)
gives every zoo model exactly the structure, shapes, dtypes and sharding annotations that
tracing its constructor in full (`nnx.eval_shape`) gives; a build whose values are kept is left
as written."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx
from zoo.engine import abstract, registry
from zoo.engine.build import build_model

import zoo
from zoo.api import resolved_hparams

BUILDS = {
    "xor": [],
    "mlp": [],
    "cnn": [],
    "vae": [],
    "gpt": ["model.depth=3"],
    "gpt-untied-biased": ["model=gpt", "model.tie_embeddings=false", "model.attention_bias=true"],
    "vit": ["model.depth=3"],
    "resnet-basic": ["model=resnet", "model.stage_sizes=[2,3]"],
    "resnet-bottleneck": ["model=resnet", "model.block=bottleneck", "model.stage_sizes=[3,1]"],
}


def hparams(build: str) -> dict:
    overrides = BUILDS[build]
    if not any(o.startswith("model=") for o in overrides):
        overrides = [f"model={build}", *overrides]
    return resolved_hparams(zoo.compose(overrides))


def described(model: nnx.Module) -> tuple:
    graphdef, state = nnx.split(model)
    return graphdef, [
        (path, type(v).__name__, v.shape, v.dtype, v.get_metadata())
        for path, v in nnx.to_flat_state(state)
    ]


@pytest.mark.parametrize("build", BUILDS)
def test_an_abstract_build_equals_the_full_trace(build):
    params = hparams(build)
    entry = registry.get_model(params["name"])
    with nnx.use_eager_sharding(False):
        full = nnx.eval_shape(lambda: build_model(entry, params, 0))
        fast = abstract.eval_shape(lambda: build_model(entry, params, 0))
    assert described(fast) == described(full)
    variables = [v for _, v in nnx.to_flat_state(nnx.state(fast))]
    assert len({id(v) for v in variables}) == len(variables)  # no clone shares a variable


def test_outside_an_abstract_build_the_initialisers_run():
    entry, params = registry.get_model("gpt"), hparams("gpt")

    def failing():
        build_model(entry, params, 0)
        raise RuntimeError("the build failed")

    with nnx.use_eager_sharding(False):
        with pytest.raises(RuntimeError, match="the build failed"):
            abstract.eval_shape(failing)
        model = build_model(entry, params, 0)
    kernels = [block.mlp_in.kernel[...] for block in model.blocks]
    assert all(np.abs(k).max() > 0 for k in kernels)
    assert not np.array_equal(kernels[0], kernels[1])  # each layer from its own key

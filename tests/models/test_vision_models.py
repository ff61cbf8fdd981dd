"""Every model of the vision zoo, small, on real data (digits) and a real 8-device mesh: it builds
with params born sharded as annotated, trains (loss goes down), evaluates; plus the two ways NNX
holds randomness (vit: call-time keys; cnn: module-bound stream) and BatchNorm's two modes."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import overriding, read_events, scalar_steps
from zoo.engine.loop import Trainer
from zoo.engine.registry import get_data

import zoo

# Small versions of each model, so that a few dozen steps on 8 simulated devices take seconds.
SMALL = {
    "mlp": {"hidden_sizes": [32, 32, 32]},
    "cnn": {"channels": [8, 16, 16]},
    "resnet": {"width": 8, "stage_sizes": [1, 1]},
    "vit": {"patch_size": 2, "dim": 16, "depth": 2, "num_heads": 2},
}
MESH = {"data": 2, "fsdp": 2, "tensor": 2}


def config(name: str, workdir, *extra: str):
    return zoo.compose(
        overriding(
            f"model={name}",
            "data=digits",
            f"workdir={workdir}",
            "trainer.steps=60",
            "trainer.batch_size=64",
            "trainer.log_every=20",
            "optimizer.warmup_steps=0",
            "optimizer.schedule=constant",
            "optimizer.learning_rate=0.01",
            *(f"mesh.{axis}={size}" for axis, size in MESH.items()),
            *(f"model.{key}={json.dumps(value)}" for key, value in SMALL[name].items()),
            *extra,
        )
    )


@pytest.fixture(scope="module", params=list(SMALL))
def trained(request, tmp_path_factory):
    """(name, trainer, result): the small model trained 60 steps on the (2, 2, 2) mesh."""
    workdir = tmp_path_factory.mktemp(request.param)
    trainer = Trainer(config(request.param, workdir))
    return request.param, trainer, trainer.fit()


def test_trains_and_evaluates(trained):
    _, _, result = trained
    losses = scalar_steps(read_events(result.workdir), "train/loss")
    assert sorted(losses) == [20, 40, 60]
    assert losses[60] < 0.7 * losses[20], losses
    assert result.eval_metrics["accuracy"] > 0.5, result.eval_metrics  # chance: 0.1


def test_params_are_born_sharded_as_annotated(trained):
    name, trainer, result = trained
    rows = {row.path: row for row in trainer.plan.rows if row.group == "params"}
    params = nnx.to_flat_state(nnx.state(result.model, nnx.Param))
    assert params
    split = []
    for path, variable in params:
        key = ".".join(str(part) for part in path)
        axes = variable.get_metadata().get("out_sharding")
        assert axes is not None and len(axes) == variable[...].ndim, f"{key}: {axes}"
        spec = jax.typeof(variable[...]).sharding.spec
        assert spec == rows[key].spec, key
        assert spec == trainer.rules.spec(axes, variable[...].shape, trainer.mesh, key), key
        split += [key] if any(entry is not None for entry in spec) else []
    assert split, f"{name}: no param is split over the mesh"


def _digits_images(count: int = 64) -> np.ndarray:
    splits = get_data("digits").splits({})
    return splits.transform({"image": splits.eval["image"][:count]})["image"]


@nnx.jit
def _call_with_rngs(model, images, rngs):
    return model(images, rngs=rngs)


@nnx.jit
def _call(model, images):
    return model(images)


HAS_BATCHNORM = {"mlp": False, "cnn": True, "resnet": True, "vit": False}


def test_batchnorm_statistics_move_in_train_mode_only(trained):
    name, _, result = trained
    model, images = nnx.clone(result.model), _digits_images()  # returned in eval mode

    def stats():
        return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.BatchStat))]

    start = stats()
    assert bool(start) == HAS_BATCHNORM[name]
    with result.activate():
        _call(model, images)
        for before, after in zip(start, stats(), strict=True):
            np.testing.assert_array_equal(before, after)
        model.train()
        if name == "vit":  # train-mode dropout draws from call-time keys
            _call_with_rngs(model, images, nnx.Rngs(0))
        else:
            _call(model, images)
    moved = [not np.allclose(b, a) for b, a in zip(start, stats(), strict=True)]
    assert all(moved), f"{sum(moved)} of {len(moved)} statistics moved"


DROPOUT_DRAWS = {"mlp": 3 * 60, "cnn": 60, "resnet": None, "vit": None}
"""Per model, the draws its module-bound Dropout stream made in 60 steps; None: it holds none."""


def test_module_bound_streams_advance_and_call_time_models_hold_none(trained):
    name, _, result = trained
    counts = [int(c) for c in jax.tree.leaves(nnx.state(result.model, nnx.RngCount))]
    if DROPOUT_DRAWS[name] is None:
        assert counts == [], f"{name} should hold no random stream"
    else:
        assert counts == [DROPOUT_DRAWS[name]]


def test_a_shape_the_model_cannot_take_is_named(tmp_path):
    with pytest.raises(zoo.ZooError, match=r"8x8 images do not split into 3x3 patches"):
        Trainer(config("vit", tmp_path, "model.patch_size=3"))
    assert not any(tmp_path.iterdir())  # nothing written

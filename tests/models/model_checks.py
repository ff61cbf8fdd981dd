"""What the models' own tests share (the checks every model passes are tests/conformance/): a
model of the zoo born sharded on the 2x2x2 mesh and the same params on one device, its outputs
on either, BatchNorm's two modes, and real inputs for it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from conformance.checks import MESH, ONE_DEVICE, on_mesh, on_one_device, tiny_config
from flax import nnx

import zoo
from zoo.trained import resolved_hparams


class Models:
    """A model of the zoo, fresh from seed 0: born sharded on the (2, 2, 2) mesh (`split`),
    and the same params gathered onto one device (`one`)."""

    def __init__(self, name: str, data: str, **hparams: Any):
        self.name, self.data, self.hparams = name, data, hparams
        self.split = zoo.create_model(
            name, data=data, mesh=MESH, devices=jax.devices()[:8], **hparams
        )
        self.one = on_one_device(self.split)

    @classmethod
    def tiny(cls, name: str, *overrides: str) -> Models:
        """The model as its registered tiny configuration makes it, `overrides` on top."""
        config = tiny_config(name, *overrides)
        hparams = {k: v for k, v in resolved_hparams(config).items() if k != "name"}
        return cls(name, config.data.name, **hparams)

    def fresh(self) -> nnx.Module:
        """A copy of the one-device model in arrays of its own, to change (or donate) freely."""
        graphdef, state = nnx.split(self.one)
        return nnx.merge(graphdef, jax.tree.map(lambda x: x.copy(), state))


def outputs(model: nnx.Module, mesh: Mapping[str, int], call: Callable, *inputs: Any) -> Any:
    """`call(model, *inputs)` jitted on `mesh`, as host arrays."""
    with on_mesh(mesh):
        return jax.tree.map(np.asarray, nnx.jit(call)(model, *inputs))


def assert_batchnorm_moves_in_train_mode_only(models: Models, images: np.ndarray) -> None:
    """In eval mode the running statistics stay where they are; in train mode the layers
    normalise with the batch's statistics (other outputs) and move the running ones."""
    model = models.fresh()

    def stats() -> list[np.ndarray]:
        return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.BatchStat))]

    def call(model, images):
        return model(images)

    start = stats()
    assert start
    model.eval()
    eval_out = outputs(model, ONE_DEVICE, call, images)
    for before, after in zip(start, stats(), strict=True):
        np.testing.assert_array_equal(before, after)
    model.train()
    train_out = outputs(model, ONE_DEVICE, call, images)
    assert all(not np.allclose(b, a) for b, a in zip(start, stats(), strict=True))
    assert not np.allclose(eval_out, train_out)


def digits(count: int = 16, normalize: bool = True) -> dict[str, np.ndarray]:
    """The first `count` eval digits (8x8x1), as the models see them."""
    splits = zoo.load_data("digits", normalize=normalize)
    images = splits.transform({"image": splits.eval["image"][:count]})["image"]
    return {"image": images, "label": splits.eval["label"][:count]}

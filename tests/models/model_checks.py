"""What every model's own tests check, each model with its own small config and inputs: its
outputs, its sharding plan on the 8-device (2, 2, 2) mesh against one device, that a few steps
lower its loss, and its train and eval modes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from zoo.engine import registry, sharding
from zoo.engine import rngs as zoo_rngs
from zoo.engine.sharding import DEFAULT_RULES
from zoo.engine.steps import make_train_step, means, zero_metrics

import zoo

MESH = {"data": 2, "fsdp": 2, "tensor": 2}
ONE_DEVICE = {"data": 1, "fsdp": 1, "tensor": 1}


def _mesh(sizes: Mapping[str, int]) -> jax.sharding.Mesh:
    devices = jax.devices()[: int(np.prod(list(sizes.values())))]
    return sharding.make_mesh(dict(sizes), devices)


@contextlib.contextmanager
def on_mesh(sizes: Mapping[str, int] = MESH) -> Iterator[None]:
    with sharding.activate(_mesh(sizes), sharding.AxisRules.from_mapping(DEFAULT_RULES)):
        yield


class Models:
    """A model of the zoo, fresh from seed 0: born sharded on the (2, 2, 2) mesh (`split`),
    and the same params gathered onto one device (`one`)."""

    def __init__(self, name: str, data: str, **hparams: Any):
        self.name, self.data, self.hparams = name, data, hparams
        self.split = zoo.create_model(
            name, data=data, mesh=MESH, devices=jax.devices()[:8], **hparams
        )
        graphdef, state = nnx.split(self.split)
        one = NamedSharding(_mesh(ONE_DEVICE), P())
        self.one = nnx.merge(graphdef, jax.tree.map(lambda x: jax.device_put(x, one), state))

    def fresh(self) -> nnx.Module:
        """A copy of the one-device model in arrays of its own, to change (or donate) freely."""
        graphdef, state = nnx.split(self.one)
        return nnx.merge(graphdef, jax.tree.map(lambda x: x.copy(), state))


def outputs(model: nnx.Module, mesh: Mapping[str, int], call: Callable, *inputs: Any) -> Any:
    """`call(model, *inputs)` jitted on `mesh`, as host arrays."""
    with on_mesh(mesh):
        return jax.tree.map(np.asarray, nnx.jit(call)(model, *inputs))


def assert_same_on_one_device_and_the_mesh(
    models: Models, call: Callable, *inputs: Any, rtol: float = 1e-5
) -> Any:
    """In eval mode, the model computes the same outputs on one device and split over the
    (2, 2, 2) mesh (to float rounding: sharded sums add in another order); returns them."""
    models.one.eval()
    models.split.eval()
    one = outputs(models.one, ONE_DEVICE, call, *inputs)
    split = outputs(models.split, MESH, call, *inputs)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol), one, split)
    return one


def assert_born_sharded_as_planned(model: nnx.Module) -> list[str]:
    """Every param is annotated on each of its dimensions and lives where the rules put it on
    the (2, 2, 2) mesh; returns the paths of those split over it (at least one)."""
    rules, mesh = sharding.AxisRules.from_mapping(DEFAULT_RULES), _mesh(MESH)
    split = []
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        key = ".".join(str(part) for part in path)
        axes = variable.get_metadata().get("out_sharding")
        assert axes is not None and len(axes) == variable[...].ndim, f"{key}: {axes}"
        spec = jax.typeof(variable[...]).sharding.spec
        assert spec == rules.spec(axes, variable[...].shape, mesh, key), key
        split += [key] if any(entry is not None for entry in spec) else []
    assert split, "no param is split over the mesh"
    return split


def assert_a_few_steps_lower_the_loss(
    models: Models, batch: Mapping[str, np.ndarray], steps: int = 8
) -> None:
    """Adam steps (learning rate 1e-2) of the run's own train step on one fixed batch, on one
    device: the loss falls by a tenth at least, and never becomes NaN."""
    model = models.fresh()
    with on_mesh(ONE_DEVICE):
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        graphdef, state = nnx.split((model, optimizer))
        step = make_train_step(graphdef, registry.get_model(models.name).loss)
        key, placed = zoo_rngs.step_key(0), jax.device_put(dict(batch))
        zeros = zero_metrics(step, state, {}, placed, key)
        losses = []
        for _ in range(steps):
            state, sums = step(state, zeros, placed, key)
            losses.append(means(sums)["loss"])
    assert all(np.isfinite(losses)), losses
    assert losses[-1] < 0.9 * losses[0], losses


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

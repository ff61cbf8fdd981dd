"""`trainer.grad_accum_steps`: N microbatches in a scan inside the step give the full batch's
gradient and update (models without BatchNorm), on one device and on a 2x2x2 mesh."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import one_step, overriding
from zoo.engine import registry
from zoo.engine.errors import ZooError
from zoo.engine.loop.trainer import Trainer

import zoo

# Each model as its registered tiny config makes it, without dropout (its draws differ between
# one batch and its microbatches).
MODELS = {
    "mlp": ("model.dropout_rate=0",),
    "gpt": (),
    "vit": ("model.dropout_rate=0",),
}
# SGD: the update is linear in the gradient, so it shows the gradient's agreement as it is (Adam's
# first step divides each gradient by its own size, magnifying rounding in the tiny ones).
COMMON = (
    "trainer.batch_size=16",
    "optimizer.name=sgd",
    "optimizer.warmup_steps=0",
    "logging.norms_every=0",
)
MESH = {"data": 2, "fsdp": 2, "tensor": 2}
CASES = [("mlp", {}), ("gpt", {}), ("vit", {}), ("gpt", MESH)]


def trainer(model: str, workdir, mesh: dict[str, int], *extra: str) -> Trainer:
    sizes = {"data": 1, "fsdp": 1, "tensor": 1, **mesh}
    overrides = [f"mesh.{axis}={size}" for axis, size in sizes.items()]
    tiny = registry.get_model(model).tiny
    own = (f"model={model}", *tiny, *MODELS[model], *COMMON, f"workdir={workdir}")
    cfg = zoo.compose(overriding(*own, *overrides, *extra))
    devices = jax.devices()[: int(np.prod(list(sizes.values())))]
    return Trainer(cfg, devices)


def updated_params(t: Trainer) -> list[np.ndarray]:
    """The params after the first train step."""
    from zoo.engine.sharding import mesh as sharding

    batch = next(iter(t.train_data))
    with sharding.activate(t.mesh, t.rules):
        sums = {}
        state, _ = t.train_step(t.state, sums, t.shard(batch), t.step_key)
    return jax.device_get(jax.tree.leaves(nnx.filter_state(state[0], nnx.Param)))


@pytest.mark.parametrize(("model", "mesh"), CASES, ids=["mlp", "gpt", "vit", "gpt-2x2x2"])
def test_four_microbatches_give_the_full_batch_update(model, mesh, tmp_path):
    full = trainer(model, tmp_path / "full", mesh)
    accumulated = trainer(model, tmp_path / "acc", mesh, "trainer.grad_accum_steps=4")
    full_loss, full_grads = one_step(full)
    loss, grads = one_step(accumulated)
    np.testing.assert_allclose(loss, full_loss, rtol=1e-5)
    for got, want in zip(grads, full_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    for got, want in zip(updated_params(accumulated), updated_params(full), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_a_batch_that_microbatches_cannot_split_is_refused(tmp_path):
    with pytest.raises(ZooError, match=r"grad_accum_steps=3.*multiple of 24"):
        trainer("mlp", tmp_path, {"data": 8}, "trainer.batch_size=64", "trainer.grad_accum_steps=3")

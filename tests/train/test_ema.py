"""`optimizer.ema_decay`: the average of the params that the run produced, kept in the
optimizer state (sharded like the params, checkpointed), evaluated beside the raw weights."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import overriding, read_events
from zoo.engine.errors import ZooError
from zoo.engine.loop.trainer import Trainer
from zoo.engine.sharding import mesh as sharding

import zoo

DECAY = 0.8
MLP = (
    "model=mlp",
    "data=digits",
    "model.hidden_sizes=[32,32]",
    "trainer.batch_size=16",
    "trainer.steps=8",
    "trainer.log_every=4",
    "trainer.eval_every=4",
    "optimizer.warmup_steps=0",
    "logging.norms_every=0",
    f"optimizer.ema_decay={DECAY}",
    "mesh.data=2",
    "mesh.fsdp=2",
    "mesh.tensor=2",
)


def params(state) -> list[np.ndarray]:
    return jax.device_get(jax.tree.leaves(nnx.filter_state(state[0], nnx.Param)))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run stepped one step at a time: its params after every step, and the trainer. Between
    two steps the caller's code runs outside the run's mesh."""
    workdir = tmp_path_factory.mktemp("ema")
    trainer = Trainer(zoo.compose(overriding(*MLP, f"workdir={workdir}")))
    history = []
    for _ in trainer.steps():
        assert jax.sharding.get_abstract_mesh().empty
        history.append(params(trainer.state))
    return trainer, history, workdir


def test_the_average_equals_one_computed_from_the_params_history(run):
    trainer, history, _ = run
    assert len(history) == 8
    average = [np.zeros_like(p) for p in history[0]]
    for step in history:
        average = [DECAY * a + (1 - DECAY) * p for a, p in zip(average, step, strict=True)]
    expected = [a / (1 - DECAY**8) for a in average]
    with sharding.activate(trainer.mesh, trainer.rules):
        got = params(trainer.averaged(trainer.state))
    for g, e, last in zip(got, expected, history[-1], strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-7)
    assert not all(np.allclose(g, last) for g, last in zip(got, history[-1], strict=True))


def test_the_average_is_sharded_like_the_params(run):
    trainer, _, _ = run
    _, optimizer = nnx.merge(trainer.graphdef, trainer.state)
    average = nnx.to_flat_state(optimizer.opt_state[-1].average)
    model_params = dict(nnx.to_flat_state(nnx.filter_state(trainer.state[0], nnx.Param)))
    assert len(average) == len(model_params) > 0
    for path, variable in average:
        assert variable[...].sharding == model_params[path][...].sharding, path
    assert any(len(v[...].sharding.device_set) > 1 for _, v in average)


def test_eval_ema_is_logged_beside_eval(run):
    _, _, workdir = run
    tags = read_events(workdir).Tags()["scalars"]
    assert {"val/loss", "val_ema/loss", "val_ema/accuracy"} <= set(tags)


def test_a_decay_outside_zero_to_one_is_refused(tmp_path):
    with pytest.raises(ZooError, match=r"optimizer.ema_decay=1.0 must lie strictly between"):
        zoo.compose(overriding(*MLP, f"workdir={tmp_path}", "optimizer.ema_decay=1.0"))


def test_load_with_ema_weights_gives_the_evaluated_average(run):
    trainer, _, workdir = run
    with sharding.activate(trainer.mesh, trainer.rules):
        expected = params(trainer.averaged(trainer.state))
    loaded = zoo.load(workdir, weights="ema")
    got = jax.device_get(jax.tree.leaves(nnx.state(loaded.model, nnx.Param)))
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-6)
    raw = zoo.load(workdir)
    assert not np.allclose(jax.tree.leaves(nnx.state(raw.model, nnx.Param))[0], got[0])
    with pytest.raises(ZooError, match=r"weights='average' must be 'raw'"):
        zoo.load(workdir, weights="average")

"""The generic trainer on real meshes, with a model holding BatchNorm and Dropout state."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import stateful_model
from flax import nnx
from helpers import assert_same_bits, overriding, read_events, scalar_steps
from jax.sharding import PartitionSpec as P
from zoo.engine.checkpoints.manager import Checkpointer
from zoo.engine.checkpoints.reader import abstract_like
from zoo.engine.loop.trainer import Trainer
from zoo.engine.pipeline import batches as pipeline
from zoo.engine.registry import get_data
from zoo.engine.sharding import mesh as sharding
from zoo.engine.steps.functions import make_grad_step
from zoo.engine.steps.norms import global_norm

import zoo

MODEL = stateful_model.NAME


def train(tmp_path, *overrides: str) -> zoo.RunResult:
    return zoo.run(zoo.compose(overriding(f"model={MODEL}", f"workdir={tmp_path}", *overrides)))


def fresh(seed: int = 0) -> nnx.Module:
    return zoo.create_model(MODEL, seed=seed)


def params(model: nnx.Module):
    return jax.tree.leaves(nnx.state(model, nnx.Param))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return train(
        tmp_path_factory.mktemp("run"), "trainer.eval_every=20", "trainer.checkpoint_every=25"
    )


def test_batchnorm_stats_and_dropout_stream_advance_in_training(run):
    start = fresh()
    assert not np.allclose(run.model.bn.mean[...], start.bn.mean[...])
    assert not np.allclose(run.model.bn.var[...], start.bn.var[...])
    assert int(run.model.drop.rngs.count[...]) == 60  # one dropout draw per step, carried out
    assert run.model.drop.deterministic and run.model.bn.use_running_average  # eval mode


def test_eval_mode_leaves_batchnorm_stats_alone(run):
    stats = [np.asarray(x) for x in jax.tree.leaves(nnx.state(run.model, nnx.BatchStat))]
    inputs = get_data("xor").splits({}).eval["inputs"][:64]
    with run.activate():
        run.model(inputs)
    for before, after in zip(stats, jax.tree.leaves(nnx.state(run.model, nnx.BatchStat))):
        np.testing.assert_array_equal(before, np.asarray(after))


def test_eval_metrics_weight_every_example_once(run):
    """500 eval points in batches of 64: the last batch holds 52 real rows and 12 padding."""
    eval_split = get_data("xor").splits({}).eval
    # One call over all 500 points (wrapped to 504 rows so 8 devices split them evenly).
    padded = {
        name: np.resize(column, (504, *column.shape[1:])) for name, column in eval_split.items()
    }
    with run.activate():
        loss, metrics = zoo.get_model(MODEL).loss(run.model, padded, nnx.Rngs(0))
    loss, accuracy = np.asarray(loss)[:500], np.asarray(metrics["accuracy"])[:500]
    np.testing.assert_allclose(run.eval_metrics["loss"], loss.mean(), rtol=1e-5)
    np.testing.assert_allclose(run.eval_metrics["accuracy"], accuracy.mean())
    assert len(list(pipeline.eval_batches(eval_split, 64))) == 8


def test_same_seed_same_bits_other_seed_other_bits(run, tmp_path):
    again = train(tmp_path / "again", "trainer.eval_every=20", "trainer.checkpoint_every=25")
    assert_same_bits(again.state, run.state)
    other = train(tmp_path / "other", "seed=1")
    assert not np.array_equal(params(run.model)[0], params(other.model)[0])


def test_tensorboard_events_hold_train_and_eval_curves(run):
    events = read_events(run.workdir)
    assert sorted(scalar_steps(events, "val/accuracy")) == [20, 40, 60]
    assert sorted(scalar_steps(events, "train/loss")) == [20, 40, 60]
    assert scalar_steps(events, "vitals/learning_rate")[60] == pytest.approx(0.01)
    assert scalar_steps(events, "vitals/steps_per_sec")[60] > 0
    assert scalar_steps(events, "val/accuracy")[60] == pytest.approx(run.eval_metrics["accuracy"])
    config_text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert f"name: {MODEL}" in config_text and "batch_size: 64" in config_text


def test_checkpoints_restore_the_final_state_bit_for_bit(run):
    checkpointer = Checkpointer(f"{run.workdir}/checkpoints")
    try:
        assert checkpointer.all_steps() == [25, 50, 60]
        restored = checkpointer.restore_state(60, abstract_like(run.state))
        config = checkpointer.restore_config(60)
    finally:
        checkpointer.close()
    assert_same_bits(restored, run.state)
    assert config["model"]["name"] == MODEL and config["trainer"]["steps"] == 60


def test_multi_device_mesh_matches_single_device(run, tmp_path):
    sharded = train(
        tmp_path,
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "trainer.eval_every=20",
        "trainer.checkpoint_every=25",
    )
    kernel = sharded.model.fc1.kernel[...]
    assert jax.typeof(kernel).sharding.spec == P("fsdp", "tensor")
    assert len(kernel.sharding.device_set) == 8
    for a, b in zip(params(run.model), params(sharded.model), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)


def test_update_norms_measure_the_gradients_the_step_applies(tmp_path):
    """With the backbone frozen, `vitals/grad_norm` is the norm of the head's gradients (those
    the step applies), not of every param's."""
    cfg = zoo.compose(
        [
            "model=mlp",
            "data=digits",
            f"workdir={tmp_path}",
            "model.hidden_sizes=[32,32]",
            "finetune.freeze=backbone",
        ]
    )
    trainer = Trainer(cfg, jax.devices()[:1])
    loss_fn = zoo.get_model("mlp").loss
    with sharding.activate(trainer.mesh, trainer.rules):
        batch = trainer.shard(next(iter(trainer.train_data)))
        norms = trainer.norms_step(trainer.state, batch, trainer.step_key)
        _, applied = trainer.jitted.grad(trainer.state, batch, trainer.step_key)
        _, every = make_grad_step(trainer.graphdef, loss_fn)(trainer.state, batch, trainer.step_key)
    assert {path[0] for path, _ in nnx.to_flat_state(applied)} == {"head"}
    applied_norm = float(global_norm(jax.tree.leaves(applied)))
    np.testing.assert_allclose(float(norms["grad_norm"]), applied_norm, rtol=1e-6)
    assert applied_norm < float(global_norm(jax.tree.leaves(every)))
    head = jax.tree.leaves(nnx.state(nnx.merge(trainer.graphdef, trainer.state)[0].head, nnx.Param))
    np.testing.assert_allclose(float(norms["param_norm"]), float(global_norm(head)), rtol=1e-6)

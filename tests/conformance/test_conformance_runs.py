"""Every model, tiny, trained a few steps by the real trainer on the 2x2x2 mesh of 8 devices:
its params are born sharded as their logical axes say, its loss on one device is its loss on
the mesh, the steps lower it, and the Orbax checkpoint the run writes loads back (`zoo.load`)
bit for bit. `zoo.predict`, `zoo.evaluate` and `zoo.finetune` answer what the model can take
and refuse, by name and before anything runs or is written, every input it cannot."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import pytest
from conformance import bad_inputs
from conformance.checks import (
    MESH,
    ONE_DEVICE,
    assert_born_sharded_as_planned,
    born_sharding,
    data_params,
    make_mesh,
    on_one_device,
    tiny_config,
    tiny_models,
)
from flax import nnx
from omegaconf import DictConfig
from zoo.engine.loop.trainer import Trainer
from zoo.engine.pipeline import batches as pipeline

import zoo
from benchmarks import state_hashes
from zoo.inputs import Reads
from zoo.trained import resolved_hparams

TRAINING = (*state_hashes.TRAINING, *(f"mesh.{axis}={size}" for axis, size in MESH.items()))
"""A few steps of Adam at a rate that moves a tiny model, on the 2x2x2 mesh; no norms sampled."""


@dataclasses.dataclass
class Run:
    name: str
    config: DictConfig
    born: list  # `born_sharding` of the model the trainer built
    at_birth: zoo.TrainedModel  # that model, copied onto one device
    loss_at_birth: dict[str, float]  # the trainer's eval of it, on the mesh
    result: zoo.RunResult
    loaded: zoo.TrainedModel  # the run's checkpoint, loaded onto the mesh
    columns: dict[str, np.ndarray]  # eval examples as the model takes them


@pytest.fixture(scope="module", params=tiny_models())
def run(request, tmp_path_factory) -> Run:
    name, workdir = request.param, tmp_path_factory.mktemp(request.param)
    config = tiny_config(name, *TRAINING, f"workdir={workdir}")
    trainer = Trainer(config)
    model, _ = nnx.merge(trainer.graphdef, trainer.state)
    copy = on_one_device(model)
    copy.eval()
    mesh = make_mesh(ONE_DEVICE)
    at_birth = zoo.TrainedModel(copy, config, 0, str(workdir), mesh, trainer.rules, {})
    born, loss_at_birth = born_sharding(model, trainer.mesh), trainer.evaluate()
    result = trainer.fit()
    splits = zoo.load_data(config.data.name, **data_params(config))
    first = pipeline.eval_batches(splits.eval, 16, transform=splits.transform)[0]
    columns = {key: value for key, value in first.items() if key != pipeline.MASK}
    loaded = zoo.load(workdir, mesh=MESH)
    return Run(name, config, born, at_birth, loss_at_birth, result, loaded, columns)


def test_params_are_born_sharded_as_their_logical_axes_say(run):
    assert_born_sharded_as_planned(run.born)


def test_the_loss_on_one_device_is_the_loss_on_the_mesh(run):
    splits = zoo.load_data(run.config.data.name, **data_params(run.config))
    one_device = zoo.evaluate(run.at_birth, splits)
    assert one_device.keys() == run.loss_at_birth.keys()
    for metric, value in run.loss_at_birth.items():
        assert one_device[metric] == pytest.approx(value, rel=1e-5, abs=1e-6), metric


def test_a_few_steps_lower_the_loss(run):
    before, after = run.loss_at_birth["loss"], run.result.eval_metrics["loss"]
    assert np.isfinite(after) and after < before, (before, after)


def test_the_checkpoint_loads_back_bit_identical(run):
    saved = nnx.to_flat_state(nnx.state(run.result.model))
    loaded = nnx.to_flat_state(nnx.state(run.loaded.model))
    assert [path for path, _ in loaded] == [path for path, _ in saved]
    for (path, want), (_, got) in zip(saved, loaded, strict=True):
        assert got[...].dtype == want[...].dtype, path
        np.testing.assert_array_equal(bits(got[...]), bits(want[...]), str(path))
    assert run.loaded.step == 20 and run.loaded.eval_metrics == run.result.eval_metrics


def bits(array: jax.Array) -> np.ndarray:
    """An array's contents on the host; a random key's as its raw data."""
    if jax.dtypes.issubdtype(array.dtype, jax.dtypes.prng_key):
        array = jax.random.key_data(array)
    return np.asarray(array)


def good_inputs(run: Run) -> np.ndarray:
    """The model's inputs for the eval examples, as `zoo.predict` takes them."""
    reads = Reads.of(run.config)
    inputs = run.columns[reads.column]
    return inputs[:, : reads.context_length] if reads.context_length else inputs


def test_predict_answers_a_batch_with_outputs_for_each_example(run):
    inputs = good_inputs(run)
    outputs = jax.tree.leaves(zoo.predict(run.loaded, inputs))
    assert outputs and all(out.shape[0] == len(inputs) for out in outputs)
    assert all(np.isfinite(out).all() for out in outputs)


@pytest.mark.parametrize("case", bad_inputs.PREDICT)
def test_predict_refuses_by_name_what_the_model_cannot_take(run, case):
    bad, named = bad_inputs.PREDICT[case](good_inputs(run))
    with pytest.raises(zoo.ZooError, match=named):
        zoo.predict(run.loaded, bad)


def bad_columns(run: Run, cases: dict, case: str) -> tuple[dict[str, Any], str]:
    hparams = resolved_hparams(run.config)
    bad, named = cases[case](run.columns, Reads.of(run.config).column, hparams)
    if bad is None:
        pytest.skip(f"model '{run.name}' has no classes")
    return bad, named


@pytest.mark.parametrize("case", [*bad_inputs.COLUMNS, *bad_inputs.WIDER_COLUMNS])
def test_evaluate_refuses_by_name_what_the_model_cannot_read(run, case):
    bad, named = bad_columns(run, {**bad_inputs.COLUMNS, **bad_inputs.WIDER_COLUMNS}, case)
    with pytest.raises(zoo.ZooError, match=named):
        zoo.evaluate(run.loaded, bad)


@pytest.mark.parametrize("case", bad_inputs.COLUMNS)
def test_finetune_refuses_by_name_data_the_model_cannot_read(run, case, tmp_path):
    bad, named = bad_columns(run, bad_inputs.COLUMNS, case)
    data = zoo.Splits(train=bad, eval=run.columns)
    with pytest.raises(zoo.ZooError, match=named):
        zoo.finetune(run.result, "trainer.steps=1", f"workdir={tmp_path / 'tuned'}", data=data)
    assert not (tmp_path / "tuned").exists()  # refused before anything was written

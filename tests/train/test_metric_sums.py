"""The zero window sums a run starts from (`zero_metrics`): a train step names its sums from a
trace of its loss alone, and they are the sums the whole step returns, name for name, each a
float32 scalar: with a weighted loss (a language model's), with microbatches and in bfloat16."""

from __future__ import annotations

import jax
import pytest
from helpers import overriding
from zoo.engine import registry
from zoo.engine.loop.trainer import Trainer
from zoo.engine.pipeline import batches as pipeline
from zoo.engine.sharding import mesh as sharding
from zoo.engine.steps.functions import zero_metrics

import zoo

CASES = {
    "xor": ("model=xor",),
    "vae": ("model=vae", *registry.get_model("vae").tiny),
    "gpt-microbatches-bf16": (
        "model=gpt",
        *registry.get_model("gpt").tiny,
        "trainer.batch_size=8",
        "trainer.grad_accum_steps=2",
        "trainer.precision=bf16",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_zero_sums_are_those_the_whole_step_returns(case, tmp_path):
    overrides = overriding(*CASES[case], "mesh.data=1", f"workdir={tmp_path}")
    trainer = Trainer(zoo.compose(overrides), jax.devices()[:1])
    assert callable(trainer.train_step.metric_names)  # not the trace of the whole step
    with sharding.activate(trainer.mesh, trainer.rules):
        batch = trainer.shard(pipeline.peek(trainer.train_data))
        args = (trainer.state, {}, batch, trainer.step_key)
        zeros = zero_metrics(trainer.train_step, *args)
        _, whole = jax.eval_shape(trainer.train_step, *args)
    assert {name: (z.shape, z.dtype) for name, z in zeros.items()} == {
        name: (s.shape, s.dtype) for name, s in whole.items()
    }
    assert all(not z.any() for z in zeros.values())
    assert "loss" in zeros and len(zeros) > 4  # the loss's own metrics besides the counters

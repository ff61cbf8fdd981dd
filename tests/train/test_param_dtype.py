"""Params held in bfloat16 (a model's `param_dtype=bf16`): the optimizer trains them against
float32 master weights kept in its state, so updates too small for bfloat16 still add up; the
masters are checkpointed (resume is bit-identical); frozen params and a LoRA base get none."""

from __future__ import annotations

import deep_mlp
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import assert_same_bits, overriding
from zoo.engine.checkpoints.reader import restore_arrays
from zoo.engine.loop.trainer import Trainer
from zoo.engine.weights.master import MasterWeightsOptimizer, masters

import zoo
from zoo.plugin import logical_spec, partitioned

MODEL = "test_low_precision_mlp"
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


class LowPrecisionMLP(nnx.Module):
    """Two dense layers whose params are held in `param_dtype`."""

    def __init__(self, hidden: int = 32, param_dtype: str = "bf16", *, rngs: nnx.Rngs):
        def linear(din, dout, axes):
            return nnx.Linear(
                din,
                dout,
                param_dtype=DTYPES[param_dtype],
                kernel_init=partitioned(nnx.initializers.lecun_normal(), axes),
                bias_init=partitioned(nnx.initializers.zeros_init(), (axes[1],)),
                rngs=rngs,
            )

        self.hidden = linear(16, hidden, ("embed", "mlp"))
        self.head = linear(hidden, 4, ("mlp", None))

    def __call__(self, x):
        h = nnx.relu(self.hidden(x, out_sharding=logical_spec("batch", "mlp")))
        return self.head(h, out_sharding=logical_spec("batch", None)).astype(jnp.float32)


if MODEL not in zoo.list_models():
    zoo.register_model(
        MODEL,
        LowPrecisionMLP,
        loss=deep_mlp.classification_loss,
        default_data=deep_mlp.DATA,
        trainer={"steps": 8, "batch_size": 32, "log_every": 4},
        optimizer={"name": "adamw", "learning_rate": 1e-2, "schedule": "constant"},
    )


def run_config(workdir, *overrides: str):
    return zoo.compose(
        overriding(
            f"model={MODEL}",
            f"workdir={workdir}",
            "trainer.checkpoint_every=4",
            "optimizer.warmup_steps=0",
            "optimizer.ema_decay=0.9",
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.tensor=2",
            *overrides,
        )
    )


def test_many_small_updates_move_the_master_and_the_params_follow_it_rounded():
    """SGD steps of 1e-4: a bfloat16 param near 0.3 is 2^-9 from its neighbours, so each step
    alone rounds back; the master adds them up exactly as float32 params would."""
    with nnx.use_eager_sharding(False):
        low = LowPrecisionMLP(param_dtype="bf16", rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(low)
    high = nnx.merge(graphdef, jax.tree.map(lambda x: x.astype(jnp.float32), state))
    plain_low = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
    tx = optax.sgd(1e-4)
    mastered = MasterWeightsOptimizer(low, tx, wrt=nnx.Param)
    reference = nnx.Optimizer(high, tx, wrt=nnx.Param)
    bf16_alone = nnx.Optimizer(plain_low, tx, wrt=nnx.Param)
    start = jax.tree.leaves(nnx.state(low, nnx.Param))

    @nnx.jit
    def step(model, optimizer):
        optimizer.update(model, jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param)))

    for model, optimizer in ((low, mastered), (high, reference), (plain_low, bf16_alone)):
        for _ in range(50):
            step(model, optimizer)

    params = nnx.state(low, nnx.Param)
    master = jax.tree.leaves(master_of(params, mastered))
    assert {x.dtype for x in master} == {jnp.dtype(jnp.float32)}
    assert_same_bits(master, jax.tree.leaves(nnx.state(high, nnx.Param)))
    params = jax.tree.leaves(params)
    assert {x.dtype for x in params} == {jnp.dtype(jnp.bfloat16)}
    assert_same_bits(params, [m.astype(jnp.bfloat16) for m in master])
    moved = changed(params, start)
    assert moved > sum(p.size for p in params) // 2  # the master carried most params along
    # bfloat16 alone: only params near zero, where bfloat16's spacing is below the step, move.
    assert changed(jax.tree.leaves(nnx.state(plain_low, nnx.Param)), start) < moved // 4


def master_of(params: nnx.State, optimizer: MasterWeightsOptimizer) -> dict:
    return masters(nnx.to_pure_dict(params), nnx.to_pure_dict(optimizer.opt_state.remainder))


def test_weights_loaded_after_the_optimizer_is_made_are_their_own_masters():
    """A fine-tune fills the params after its optimizer exists: training goes on from them."""
    with nnx.use_eager_sharding(False):
        model = LowPrecisionMLP(param_dtype="bf16", rngs=nnx.Rngs(0))
    optimizer = MasterWeightsOptimizer(model, optax.sgd(1e-4), wrt=nnx.Param)
    loaded = jax.tree.map(lambda x: jnp.full_like(x, 0.5), nnx.state(model, nnx.Param))
    nnx.update(model, loaded)
    optimizer.update(model, jax.tree.map(jnp.ones_like, loaded))
    expected = jnp.float32(0.5) + jnp.float32(-1e-4)
    for master in jax.tree.leaves(master_of(nnx.state(model, nnx.Param), optimizer)):
        np.testing.assert_array_equal(master, np.full(master.shape, expected))
    for param in jax.tree.leaves(nnx.state(model, nnx.Param)):  # 0.5 - 1e-4 rounds to 0.5
        np.testing.assert_array_equal(param, np.full(param.shape, 0.5, param.dtype))


def changed(params: list[jax.Array], start: list[jax.Array]) -> int:
    return sum(int(np.sum(np.asarray(p != s))) for p, s in zip(params, start, strict=True))


def floats(tree) -> list[jax.Array]:
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


def state_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def counters(opt_state) -> int:
    """The bytes of the step counters (the schedule's, the EMA's)."""
    return state_bytes([x for x in jax.tree.leaves(opt_state) if x.ndim == 0])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return Trainer(run_config(tmp_path_factory.mktemp("full"))).fit()


@pytest.mark.parametrize(
    "overrides",
    [(), ("trainer.precision=bf16",), ("trainer.grad_accum_steps=2",)],
    ids=["fp32 compute", "bf16 compute", "accumulated"],
)
def test_a_run_keeps_float32_optimizer_state_and_masters(overrides, uninterrupted, tmp_path):
    result = uninterrupted if not overrides else Trainer(run_config(tmp_path, *overrides)).fit()
    model_state, optimizer_state = result.state[0], result.state[1]
    params = jax.tree.leaves(nnx.filter_state(model_state, nnx.Param))
    assert {x.dtype for x in params} == {jnp.dtype(jnp.bfloat16)}
    opt_state = optimizer_state["opt_state"]
    assert set(opt_state) == {"remainder", "inner"}  # the fields of a MasterState
    # Adam's moments, the EMA and the masters: float32, one copy of each param in each.
    assert {x.dtype for x in floats(opt_state)} == {jnp.dtype(jnp.float32)}
    assert state_bytes(opt_state) - counters(opt_state) == 4 * 2 * state_bytes(params)
    remainder = jax.tree.leaves(opt_state["remainder"])
    master = [p.astype(jnp.float32) + r for p, r in zip(params, remainder, strict=True)]
    assert_same_bits(params, [m.astype(jnp.bfloat16) for m in master])
    assert np.isfinite(result.eval_metrics["loss"])
    # The masters are sharded as their params are.
    for param, kept in zip(params, remainder, strict=True):
        assert param.sharding == kept.sharding


def test_checkpoint_and_resume_is_bit_identical(uninterrupted, tmp_path):
    Trainer(run_config(tmp_path, "trainer.steps=4")).fit()
    resumed = Trainer(run_config(tmp_path)).fit()
    assert resumed.start_step == 4
    assert_same_bits(resumed.state, uninterrupted.state)


def test_the_average_is_float32_and_loads_in_the_params_dtype(uninterrupted):
    ema = uninterrupted.state[1]["opt_state"]["inner"][1]
    assert {x.dtype for x in floats(ema["average"])} == {jnp.dtype(jnp.float32)}
    count = int(ema["count"][...])
    expected = [a / (1 - 0.9**count) for a in jax.tree.leaves(ema["average"])]
    loaded = zoo.load(uninterrupted.workdir, weights="ema")
    got = jax.tree.leaves(nnx.state(loaded.model, nnx.Param))
    assert_same_bits(got, [e.astype(jnp.bfloat16) for e in expected])


def test_lora_on_a_bfloat16_base_keeps_no_master(tmp_path):
    result = Trainer(run_config(tmp_path, "finetune.lora_rank=2", "trainer.steps=4")).fit()
    model_state, optimizer_state = result.state[0], result.state[1]
    opt_state = optimizer_state["opt_state"]
    assert "remainder" not in opt_state
    adapters = nnx.filter_state(model_state, nnx.LoRAParam)
    base = nnx.filter_state(model_state, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    assert {x.dtype for x in jax.tree.leaves(base)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}
    # Adam's two moments and the EMA of the adapters, and nothing of the base: in bytes,
    # three times the adapters, plus the step counters.
    assert state_bytes(opt_state) - counters(opt_state) == 3 * state_bytes(adapters)


def test_frozen_params_get_no_master(tmp_path):
    result = Trainer(run_config(tmp_path, "finetune.freeze=hidden", "trainer.steps=4")).fit()
    remainder = result.state[1]["opt_state"]["remainder"]
    assert set(remainder) == {"head"}


def test_a_float32_run_fine_tunes_in_bfloat16(tmp_path):
    """A run's params are read as they were saved, checked against their checksums, then cast
    to the fine-tune's `param_dtype` (reading them cast made every checksum differ)."""
    base = Trainer(run_config(tmp_path / "fp32", "model.param_dtype=fp32")).fit()
    tuned = zoo.finetune(
        base, *overriding("model.param_dtype=bf16", "trainer.steps=1", f"workdir={tmp_path}/ft")
    )
    params = jax.tree.leaves(nnx.state(tuned.model, nnx.Param))
    assert {x.dtype for x in params} == {jnp.dtype(jnp.bfloat16)}
    assert np.isfinite(tuned.eval_metrics["loss"])
    step_path = tmp_path / "fp32" / "checkpoints" / str(base.step)
    saved = jax.tree.leaves_with_path(nnx.to_pure_dict(base.state[0]))
    paths = [("0", *(str(getattr(k, "key", k)) for k in path)) for path, _ in saved]
    targets = {
        p: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=x.sharding)
        for p, (_, x) in zip(paths, saved, strict=True)
    }
    read = restore_arrays(step_path, targets)
    for path, (_, x) in zip(paths, saved, strict=True):
        assert_same_bits(read[path], x.astype(jnp.bfloat16))

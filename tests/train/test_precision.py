"""`trainer.precision=bf16`: every model of the zoo, as its `tiny` config makes it, trains in
bfloat16 to about the loss it reaches in float32, with float32 params, optimizer state and
checkpoints; also on a mesh with every axis split and with LoRA adapters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from conformance.checks import zoo_models
from flax import nnx
from helpers import overriding
from jax.extend import core as jcore
from zoo.engine import registry
from zoo.engine.checkpoints.manager import Checkpointer
from zoo.engine.checkpoints.reader import abstract_like
from zoo.engine.pipeline import batches as pipeline
from zoo.engine.sharding import mesh as sharding
from zoo.engine.steps import precision
from zoo.engine.steps import rngs as zoo_rngs
from zoo.engine.steps.functions import make_train_step, zero_metrics

import zoo

COMMON = (
    "trainer.steps=100",
    "trainer.batch_size=16",
    "trainer.log_every=100",
    "trainer.eval_every=0",
    "trainer.steps_per_dispatch=100",
    "optimizer.warmup_steps=0",
    "logging.norms_every=0",
    "mesh.data=1",
)


def tiny(model: str) -> tuple[str, ...]:
    return registry.get_model(model).tiny


def fit(model: str, workdir, *extra: str, devices: int = 1) -> zoo.RunResult:
    """A run of `model`'s tiny config on the first `devices` devices, without the model's eval
    report (a language model's sampled text, a classifier's or VAE's images): its losses,
    state and checkpoints are what these tests read, and the report's own programs took most
    of a language model's run."""
    overrides = overriding(
        f"model={model}",
        *tiny(model),
        *COMMON,
        "logging.eval_reports=false",
        f"workdir={workdir}",
        *extra,
    )
    from zoo.engine.loop.trainer import Trainer

    return Trainer(zoo.compose(overrides), jax.devices()[:devices]).fit()


def float_dtypes(tree) -> set:
    return {x.dtype for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


@pytest.mark.parametrize("model", zoo_models())
def test_bf16_trains_to_the_fp32_loss_with_float32_state(model, tmp_path):
    full = fit(model, tmp_path / "fp32")
    mixed = fit(model, tmp_path / "bf16", "trainer.precision=bf16")
    assert mixed.eval_metrics["loss"] == pytest.approx(full.eval_metrics["loss"], rel=0.05)
    assert mixed.eval_metrics["loss"] != full.eval_metrics["loss"]  # it did compute in bf16
    assert float_dtypes(mixed.state) == {jnp.dtype(jnp.float32)}
    checkpointer = Checkpointer(tmp_path / "bf16" / "checkpoints")
    try:
        saved = checkpointer.restore_state(100, abstract_like(mixed.state))
    finally:
        checkpointer.close()
    assert float_dtypes(saved) == {jnp.dtype(jnp.float32)}


def test_bf16_on_a_split_mesh_with_lora(tmp_path):
    base = ("trainer.steps=40", "trainer.steps_per_dispatch=20", "trainer.log_every=20")
    mesh = ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    lora = (*base, *mesh, "finetune.lora_rank=2")
    full = fit("gpt", tmp_path / "fp32", *lora, devices=8)
    mixed = fit("gpt", tmp_path / "bf16", *lora, "trainer.precision=bf16", devices=8)
    assert mixed.eval_metrics["loss"] == pytest.approx(full.eval_metrics["loss"], rel=0.05)
    assert float_dtypes(mixed.state) == {jnp.dtype(jnp.float32)}
    assert float_dtypes(nnx.state(mixed.model, nnx.LoRAParam)) == {jnp.dtype(jnp.float32)}


def equations(jaxpr, inside: tuple[str, ...] = ()):
    """(equation, names of the equations it lies inside) for every equation of `jaxpr` and of
    the jaxprs in its equations' params (jit, scan, remat, custom_jvp/vjp bodies), depth first."""
    for eqn in jaxpr.eqns:
        yield eqn, inside
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                if isinstance(sub, jcore.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, jcore.Jaxpr):
                    yield from equations(sub, (*inside, eqn.primitive.name))


def operand_dtypes(eqn) -> list:
    return [v.aval.dtype for v in eqn.invars]


def matmuls_not_in_bf16(jaxpr) -> list[str]:
    """The dot_generals that do not multiply bfloat16 numbers. One with a float32 operand
    passes if its algorithm is BF16_BF16_F32, which rounds the operands to bfloat16: that is
    how the backward of XLA's attention multiplies the logits' float32 cotangent."""
    return [
        str(eqn)
        for eqn, _ in equations(jaxpr)
        if eqn.primitive.name == "dot_general"
        and set(operand_dtypes(eqn)) != {jnp.dtype(jnp.bfloat16)}
        and eqn.params["precision"] != jax.lax.DotAlgorithmPreset.BF16_BF16_F32
    ]


def traced_step(trainer, train_step, batch):
    """`train_step` as the trainer dispatches it, traced (not compiled): its jaxpr and the
    shapes of its outputs."""
    sums = zero_metrics(train_step, trainer.state, {}, batch, trainer.step_key)
    args = (trainer.state, sums, batch, trainer.step_key)
    return jax.make_jaxpr(train_step, return_shape=True)(*args)


def bf16_loss_outputs(trainer, batch):
    """The shapes of the loss and metrics that the bf16 step averages, before it sums them:
    of gpt's loss as the trainer wraps it for `trainer.precision=bf16`."""
    loss_fn = precision.compute_loss(registry.get_model("gpt").loss, "bf16")

    def loss(state):
        model, _ = nnx.merge(trainer.graphdef, state)
        return loss_fn(model, batch, zoo_rngs.call_rngs(trainer.step_key, 0))

    return jax.eval_shape(loss, trainer.state)


def test_bf16_train_step_multiplies_in_bf16_and_keeps_float32_where_it_must(tmp_path):
    """The jaxpr of gpt's bf16 train step (scanned, rematerialised blocks): every matmul of the
    forward and backward passes in bfloat16; softmax (attention's and the loss's exp and max)
    and LayerNorm statistics in float32; params, optimizer state, loss and metrics float32.
    The same matmul check fails on the fp32 step."""
    extra = ("model.scan_layers=true", "model.remat=true", "trainer.precision=bf16")
    overrides = overriding("model=gpt", *tiny("gpt"), *COMMON, *extra, f"workdir={tmp_path}")
    from zoo.engine.loop.trainer import Trainer

    trainer = Trainer(zoo.compose(overrides), jax.devices()[:1])
    with sharding.activate(trainer.mesh, trainer.rules):
        batch = trainer.shard(pipeline.peek(trainer.train_data))
        jaxpr, (state, sums) = traced_step(trainer, trainer.train_step, batch)
        loss, metrics = bf16_loss_outputs(trainer, batch)
        fp32_step = make_train_step(trainer.graphdef, registry.get_model("gpt").loss)
        fp32_jaxpr, _ = traced_step(trainer, fp32_step, batch)
    found = list(equations(jaxpr.jaxpr))
    dots = [inside for eqn, inside in found if eqn.primitive.name == "dot_general"]
    assert any("scan" in inside and "remat2" in inside for inside in dots)  # walked into both
    assert matmuls_not_in_bf16(jaxpr.jaxpr) == []

    f32 = jnp.dtype(jnp.float32)
    softmax = [eqn for eqn, _ in found if eqn.primitive.name in ("exp", "reduce_max")]
    shapes = {eqn.invars[0].aval.ndim for eqn in softmax}
    # The loss's (batch x length x vocab) and attention's: batch x heads x queries x keys (on a
    # CPU, `zoo.engine.kernels.attention_cpu`), with the heads grouped (jax's kernel) a fifth
    # axis.
    assert 3 in shapes and shapes & {4, 5}
    assert {dtype for eqn in softmax for dtype in operand_dtypes(eqn)} == {f32}
    dim = trainer.cfg.model.dim
    statistics = [
        eqn
        for eqn, _ in found
        if eqn.primitive.name == "reduce_sum"
        and eqn.params["axes"] == (eqn.invars[0].aval.ndim - 1,)
        and eqn.invars[0].aval.shape[-1] == dim
    ]
    assert len(statistics) >= 2 * 3  # mean and mean square of the 3 norms a scanned pass shows
    assert {dtype for eqn in statistics for dtype in operand_dtypes(eqn)} == {f32}

    n = len(jax.tree.leaves(trainer.state))
    assert {a.dtype for a in jaxpr.in_avals[:n] if jnp.issubdtype(a.dtype, jnp.floating)} == {f32}
    assert float_dtypes(state) == {f32}
    assert float_dtypes(sums) == {f32}
    assert float_dtypes((loss, metrics)) == {f32}
    # The matmul check is not vacuous: the same trainer's fp32 step fails it.
    assert matmuls_not_in_bf16(fp32_jaxpr.jaxpr) != []

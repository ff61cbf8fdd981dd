"""`trainer.precision=bf16`: every model of the zoo trains in bfloat16 to about the loss it
reaches in float32, with float32 params, optimizer state and checkpoints; also on a mesh with
every axis split and with LoRA adapters."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import overriding

import zoo
from train.checkpoint import Checkpointer
from train.saved import abstract_like

SMALL = {
    "mlp": ("data=digits", "model.hidden_sizes=[32,32]"),
    "cnn": ("data=digits", "model.channels=[8,16,16]"),
    "resnet": ("data=digits", "model.width=8", "model.stage_sizes=[1,1]"),
    "vit": ("data=digits", "model.patch_size=2", "model.dim=16", "model.depth=2"),
    "vae": ("data=digits", "model.hidden_sizes=[64,32]", "model.latent_dim=4"),
    "xor": (),
    "gpt": (
        "model.context_length=32",
        "model.dim=32",
        "model.depth=2",
        "model.num_heads=2",
        "model.mlp_ratio=2",
        "data.window=32",
        "data.eval_bytes=4096",
    ),
}
COMMON = (
    "trainer.steps=200",
    "trainer.batch_size=16",
    "trainer.log_every=100",
    "trainer.eval_every=0",
    "trainer.steps_per_dispatch=100",
    "optimizer.warmup_steps=0",
    "logging.norms_every=0",
    "mesh.data=1",
)


def fit(model: str, workdir, *extra: str) -> zoo.RunResult:
    overrides = overriding(f"model={model}", *SMALL[model], *COMMON, f"workdir={workdir}", *extra)
    from train.loop import Trainer

    return Trainer(zoo.compose(overrides), jax.devices()[:1]).fit()


def float_dtypes(tree) -> set:
    return {x.dtype for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


@pytest.mark.parametrize("model", list(SMALL))
def test_bf16_trains_to_the_fp32_loss_with_float32_state(model, tmp_path):
    full = fit(model, tmp_path / "fp32")
    mixed = fit(model, tmp_path / "bf16", "trainer.precision=bf16")
    assert mixed.eval_metrics["loss"] == pytest.approx(full.eval_metrics["loss"], rel=0.05)
    assert mixed.eval_metrics["loss"] != full.eval_metrics["loss"]  # it did compute in bf16
    assert float_dtypes(mixed.state) == {jnp.dtype(jnp.float32)}
    checkpointer = Checkpointer(tmp_path / "bf16" / "checkpoints")
    try:
        saved = checkpointer.restore_state(200, abstract_like(mixed.state))
    finally:
        checkpointer.close()
    assert float_dtypes(saved) == {jnp.dtype(jnp.float32)}


def test_bf16_on_a_split_mesh_with_lora(tmp_path):
    base = ("trainer.steps=40", "trainer.steps_per_dispatch=20", "trainer.log_every=20")
    mesh = ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    overrides = overriding(
        "model=gpt", *SMALL["gpt"], *COMMON, *base, *mesh, "finetune.lora_rank=2"
    )
    full = zoo.run(zoo.compose([*overrides, f"workdir={tmp_path / 'fp32'}"]))
    mixed = zoo.run(
        zoo.compose([*overrides, f"workdir={tmp_path / 'bf16'}", "trainer.precision=bf16"])
    )
    assert mixed.eval_metrics["loss"] == pytest.approx(full.eval_metrics["loss"], rel=0.05)
    assert float_dtypes(mixed.state) == {jnp.dtype(jnp.float32)}
    assert float_dtypes(nnx.state(mixed.model, nnx.LoRAParam)) == {jnp.dtype(jnp.float32)}

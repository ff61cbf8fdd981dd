"""Optimizers and learning-rate schedules built from the `optimizer` config section; AdamW's
decay mask on the states of real models, as the trainer builds their optimizer."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from omegaconf import OmegaConf
from zoo.engine import registry
from zoo.engine.loop.trainer import Trainer
from zoo.engine.sharding import mesh as sharding
from zoo.engine.steps.optim import learning_rate_schedule, make_optimizer
from zoo.engine.weights.freeze import dotted

import zoo


def optimizer_config(*overrides: str):
    return zoo.compose(["model=xor", *(f"optimizer.{o}" for o in overrides)]).optimizer


def test_warmup_then_cosine_decay_to_the_final_fraction():
    opt = optimizer_config(
        "learning_rate=1.0", "schedule=cosine", "warmup_steps=10", "final_lr_fraction=0.1"
    )
    schedule = learning_rate_schedule(opt, total_steps=110)
    assert float(schedule(0)) == 0.0
    assert float(schedule(5)) == pytest.approx(0.5)
    assert float(schedule(10)) == pytest.approx(1.0)
    assert float(schedule(60)) == pytest.approx(0.55)
    assert float(schedule(110)) == pytest.approx(0.1)


def test_linear_and_constant_schedules():
    linear = learning_rate_schedule(optimizer_config("learning_rate=2.0", "schedule=linear"), 100)
    assert float(linear(50)) == pytest.approx(1.0) and float(linear(100)) == pytest.approx(0.0)
    constant = learning_rate_schedule(optimizer_config("learning_rate=0.3"), 100)
    assert float(constant(0)) == float(constant(99)) == pytest.approx(0.3)


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_each_optimizer_takes_a_step_downhill(name):
    tx, _ = make_optimizer(optimizer_config(f"name={name}", "learning_rate=0.1"), total_steps=10)
    params = {"w": jnp.array([1.0, -2.0])}
    grads = {"w": 2 * params["w"]}  # gradient of |w|^2
    updates, _ = tx.update(grads, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    assert float(jnp.sum(new["w"] ** 2)) < float(jnp.sum(params["w"] ** 2))


def test_gradient_clipping_bounds_the_update():
    tx, _ = make_optimizer(
        optimizer_config("name=sgd", "learning_rate=1.0", "grad_clip_norm=0.5"), 10
    )
    params = {"w": jnp.zeros(2)}
    updates, _ = tx.update({"w": jnp.array([30.0, 40.0])}, tx.init(params), params)
    np.testing.assert_allclose(np.linalg.norm(updates["w"]), 0.5, rtol=1e-6)


def test_warmup_longer_than_training_is_rejected():
    with pytest.raises(zoo.ZooError, match="warmup_steps=50 .* trainer.steps=10"):
        zoo.compose(
            ["trainer.steps=10", "trainer.steps_per_dispatch=1", "optimizer.warmup_steps=50"]
        )


@pytest.mark.parametrize("decay_all", [False, True])
def test_adamw_decays_kernels_only_unless_told_to_decay_all(decay_all):
    """With a zero gradient, AdamW's update is the decay alone: -lr * weight_decay * param."""
    opt = optimizer_config(
        "name=adamw", "learning_rate=0.5", "weight_decay=0.1", f"decay_all={decay_all}"
    )
    tx, _ = make_optimizer(opt, total_steps=10)
    params = {
        "dense": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)},
        "norm": {"scale": jnp.ones(2)},
        "embedding": jnp.ones((3, 2)),
        "adapter": {"lora_a": jnp.ones((2, 1)), "lora_b": jnp.ones((1, 2))},
    }
    zeros = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zeros, tx.init(params), params)
    decayed = {"kernel", "lora_a", "lora_b"}
    for path, update in jax.tree_util.tree_flatten_with_path(updates)[0]:
        expected = -0.05 if decay_all or path[-1].key in decayed else 0.0
        np.testing.assert_allclose(update, expected, err_msg=jax.tree_util.keystr(path))


GPT = ("model=gpt", *registry.get_model("gpt").tiny, "model.depth=1")
BUILT = {
    "gpt": GPT,
    "vit": (
        "model=vit",
        "data=digits",
        "model.patch_size=2",
        "model.dim=16",
        "model.depth=1",
        "model.num_heads=2",
        "model.class_token=true",
        "model.pool=cls",
        "model.attention_bias=true",
    ),
    # LoRA trains the adapters and the params that start fresh (here the final LayerNorm).
    "gpt+lora": (*GPT, "finetune.lora_rank=2", "finetune.reinit=[norm]"),
}
# Named params of each model, by whether AdamW decays them (besides the rule checked for all).
DECAYED_PARAMS = {
    "gpt": {"blocks.0.attention.query.kernel", "blocks.0.mlp_in.kernel"},
    "vit": {"embed.kernel", "blocks.0.attention.value.kernel", "head.kernel"},
    "gpt+lora": {"blocks.0.mlp_in.lora_a", "blocks.0.mlp_in.lora_b", "blocks.0.mlp_out.lora_b"},
}
KEPT_PARAMS = {
    "gpt": {"embedding", "positions", "norm.scale", "norm.bias", "blocks.0.mlp_in.bias"},
    "vit": {"class_token", "positions", "blocks.0.attention.query.bias", "norm.scale"},
    "gpt+lora": {"norm.scale", "norm.bias"},
}
ADAMW = [f"optimizer.{o}" for o in ("name=adamw", "learning_rate=0.5", "weight_decay=0.1")]


@pytest.fixture(scope="module", params=list(BUILT))
def built(request, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("optim")
    overrides = [*BUILT[request.param], *ADAMW, "optimizer.warmup_steps=0", "trainer.batch_size=16"]
    cfg = zoo.compose([*overrides, f"workdir={workdir}"])
    return request.param, Trainer(cfg, jax.devices()[:1])


def decay_factors(trainer: Trainer, decay_all: bool) -> dict[str, float]:
    """What one AdamW update with zero gradients multiplies each trained param by, set to ones
    first: 1 - 0.5 * 0.1 where it decays, 1 where not. The optimizer is the trainer's own (its
    state, over the params the trainer trains) or, for `decay_all`, one built as the trainer
    builds it, over the same params."""
    model, optimizer = nnx.merge(trainer.graphdef, trainer.state, copy=True)
    with sharding.activate(trainer.mesh, trainer.rules):
        if decay_all:
            tx, _ = make_optimizer(OmegaConf.merge(trainer.cfg.optimizer, {"decay_all": True}), 10)
            optimizer = nnx.Optimizer(model, tx, wrt=optimizer.wrt)
        after = nnx.to_flat_state(update_from_ones(*nnx.split((model, optimizer))))
    factors = {dotted(path): np.unique(np.asarray(param[...])) for path, param in after}
    assert all(len(values) == 1 for values in factors.values()), factors
    return {name: float(values[0]) for name, values in factors.items()}


@functools.partial(jax.jit, static_argnums=0)
def update_from_ones(graphdef: nnx.GraphDef, state: nnx.State) -> nnx.State:
    """The optimizer's params after an update with zero gradients from all ones (one compiled
    program: op by op, the update of a whole model takes seconds)."""
    model, optimizer = nnx.merge(graphdef, state)
    trained = nnx.state(model, optimizer.wrt)
    nnx.update(model, jax.tree.map(jnp.ones_like, trained))
    optimizer.update(model, jax.tree.map(jnp.zeros_like, trained))
    return nnx.state(model, optimizer.wrt)


@pytest.mark.parametrize("decay_all", [False, True])
def test_adamw_decays_the_real_models_weights_as_the_trainer_builds_it(built, decay_all):
    model, trainer = built
    factors = decay_factors(trainer, decay_all)
    named = DECAYED_PARAMS[model] | KEPT_PARAMS[model]
    assert named <= factors.keys(), sorted(factors)
    if model == "gpt+lora":  # the frozen base weights are no part of the optimizer
        assert all(n.endswith(("lora_a", "lora_b")) or n.startswith("norm.") for n in factors)
    for name, factor in factors.items():
        decayed = decay_all or name.rsplit(".", 1)[-1] in ("kernel", "lora_a", "lora_b")
        assert factor == pytest.approx(0.95 if decayed else 1.0, abs=1e-7), name
    assert all(factors[name] < 1 for name in DECAYED_PARAMS[model])
    assert all((factors[name] < 1) == decay_all for name in KEPT_PARAMS[model])

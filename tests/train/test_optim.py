"""Optimizers and learning-rate schedules built from the `optimizer` config section."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zoo
from train.optim import learning_rate_schedule, make_optimizer


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

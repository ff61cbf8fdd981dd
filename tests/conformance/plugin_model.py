"""A model and its data set as a project of its own registers them, through `zoo.plugin` alone:
a two-layer perceptron that tells which of two rings a point lies on. Neither states its
inputs' shape (no `input_shape`): `zoo.predict` and `zoo.evaluate` check what it cannot take by
tracing it. The conformance suite imports this module and runs the model like zoo's own."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from zoo.plugin import (
    Splits,
    logical_spec,
    loss_contract,
    partitioned,
    register_data,
    register_model,
)


def _rings(size: int, noise: float, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    label = rng.integers(0, 2, size)
    angle = rng.uniform(0, 2 * np.pi, size)
    radius = 1.0 + label + noise * rng.standard_normal(size)
    points = np.stack([radius * np.cos(angle), radius * np.sin(angle)], axis=1)
    return {"point": points.astype(np.float32), "label": label.astype(np.int32)}


@register_data("rings")
def rings(train_size: int = 2000, eval_size: int = 400, noise: float = 0.1) -> Splits:
    """Points around the circles of radius 1 (label 0) and 2 (label 1)."""
    return Splits(train=_rings(train_size, noise, 0), eval=_rings(eval_size, noise, 1))


@loss_contract(columns=("point", "label"), metrics=("accuracy",))
def ring_loss(model: nnx.Module, batch, rngs: nnx.Rngs):
    logits = model(batch["point"]).astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    return loss, {"accuracy": (logits.argmax(-1) == batch["label"]).astype(jnp.float32)}


@register_model(
    "rings",
    loss=ring_loss,
    default_data="rings",
    trainer={"steps": 500, "batch_size": 64},
    optimizer={"name": "adam", "learning_rate": 1e-2},
    tiny=("model.hidden=16", "data.train_size=256", "data.eval_size=64"),
)
class RingClassifier(nnx.Module):
    def __init__(self, hidden: int = 64, classes: int = 2, *, rngs: nnx.Rngs):
        kernel, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()
        self.hidden = nnx.Linear(
            2,
            hidden,
            kernel_init=partitioned(kernel, (None, "mlp")),
            bias_init=partitioned(zeros, ("mlp",)),
            rngs=rngs,
        )
        self.norm = nnx.LayerNorm(
            hidden,
            scale_init=partitioned(nnx.initializers.ones_init(), ("mlp",)),
            bias_init=partitioned(zeros, ("mlp",)),
            rngs=rngs,
        )
        self.output = nnx.Linear(
            hidden,
            classes,
            kernel_init=partitioned(kernel, ("mlp", None)),
            bias_init=partitioned(zeros, (None,)),
            rngs=rngs,
        )

    def __call__(self, x):
        h = nnx.relu(self.norm(self.hidden(x)))
        return self.output(h, out_sharding=logical_spec("batch", None))

"""A test model for sharding: an MLP with three hidden layers, alternately column- and
row-parallel as in Megatron, on a small registered data set of Gaussian blobs. Importable as a
plugin module (`ZOO_PLUGINS=deep_mlp`) by CLI subprocesses."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from zoo.engine.sharding.mesh import logical_spec

import zoo

MODEL, DATA = "test_deep_mlp", "test_blobs"


def classification_loss(model, batch, rngs):
    logits = model(batch["inputs"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])
    return loss, {"accuracy": (logits.argmax(-1) == batch["label"]).astype(jnp.float32)}


def _linear(din, dout, kernel_axes, bias_axis, rngs):
    return nnx.Linear(
        din,
        dout,
        kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), kernel_axes),
        bias_init=nnx.with_partitioning(nnx.initializers.normal(0.1), (bias_axis,)),
        rngs=rngs,
    )


class DeepMLP(nnx.Module):
    def __init__(self, features: int = 16, hidden: int = 64, classes: int = 4, *, rngs: nnx.Rngs):
        self.layers = nnx.List(
            [
                _linear(features, hidden, ("embed", "mlp"), "mlp", rngs),
                _linear(hidden, hidden, ("mlp", "embed"), None, rngs),
                _linear(hidden, hidden, ("embed", "mlp"), "mlp", rngs),
            ]
        )
        self.head = _linear(hidden, classes, ("mlp", None), None, rngs)

    def __call__(self, x):
        batch_only = logical_spec("batch", None)
        h = nnx.relu(self.layers[0](x))
        h = nnx.relu(self.layers[1](h, out_sharding=batch_only))  # contracts tensor-sharded dims
        h = nnx.relu(self.layers[2](h))
        return self.head(h, out_sharding=batch_only)


def blobs(
    features: int = 16, classes: int = 4, train_size: int = 512, eval_size: int = 200, seed: int = 0
) -> zoo.Splits:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(classes, features)) * 2

    def split(n):
        label = rng.integers(0, classes, n).astype(np.int32)
        inputs = centers[label] + rng.normal(size=(n, features))
        return {"inputs": inputs.astype(np.float32), "label": label}

    return zoo.Splits(train=split(train_size), eval=split(eval_size))


if MODEL not in zoo.list_models():
    zoo.register_data(DATA, blobs)
    zoo.register_model(
        MODEL,
        DeepMLP,
        loss=classification_loss,
        default_data=DATA,
        trainer={"steps": 20, "batch_size": 32, "log_every": 1},
        # SGD, not Adam: Adam divides near-zero gradients by their own magnitude, which turns
        # float rounding (that differs between meshes) into visible parameter differences.
        optimizer={"name": "sgd", "learning_rate": 0.05, "momentum": 0.9},
    )

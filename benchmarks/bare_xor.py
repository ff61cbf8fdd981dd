"""XOR trained by hand, the way an expert writes the loop: the baseline that `benchmarks.costs`
times `python -m zoo.train model=xor` against, imports included.

    python benchmarks/bare_xor.py [steps]

The same training as the zoo's default xor config: the continuous-XOR data (2,500 train and 500
eval points around the corners of the unit square, noise 0.1, seeds 42 and 123), a 2 -> 8 tanh
-> 1 classifier (LeCun-normal kernels, zero biases), binary cross-entropy, plain SGD at 0.1,
batch 128, 2,000 steps (about 100 epochs, each in a fresh order, batches running across epoch
boundaries), then one eval of the accuracy on the eval points. Nothing else: no config, no
logging, no checkpoint. The loop is the fastest per-step loop one writes by hand: the model and
optimizer split once, one `jax.jit` of a pure step with the state donated, every batch placed on
the device once, up front. It imports jax, flax, optax and numpy only, never zoo.
"""

from __future__ import annotations

import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

STEPS, BATCH, LEARNING_RATE = 2000, 128, 0.1


def continuous_xor(size: int, seed: int, noise: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    corners = rng.integers(0, 2, size=(size, 2))
    labels = (corners.sum(axis=1) == 1).astype(np.int32)
    inputs = corners + noise * rng.standard_normal((size, 2))
    return inputs.astype(np.float32), labels


class Classifier(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(2, 8, rngs=rngs)
        self.output = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.output(nnx.tanh(self.hidden(x)))[:, 0]


def loss_fn(model: Classifier, inputs: jax.Array, labels: jax.Array) -> jax.Array:
    logits = model(inputs)
    return optax.sigmoid_binary_cross_entropy(logits, labels.astype(logits.dtype)).mean()


def main(steps: int) -> None:
    train_x, train_y = continuous_xor(2500, seed=42)
    eval_x, eval_y = continuous_xor(500, seed=123)
    # Every step's rows, epoch after epoch in a fresh order, gathered and placed once.
    rng = np.random.default_rng(0)
    epochs = -(-steps * BATCH // len(train_x))
    order = np.concatenate([rng.permutation(len(train_x)) for _ in range(epochs)])
    order = order[: steps * BATCH].reshape(steps, BATCH)
    batches_x, batches_y = jax.device_put((train_x[order], train_y[order]))

    model = Classifier(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(LEARNING_RATE), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state, batches_x, batches_y, index):
        model, optimizer = nnx.merge(graphdef, state)
        grads = nnx.grad(loss_fn)(model, batches_x[index], batches_y[index])
        optimizer.update(model, grads)
        return nnx.state((model, optimizer))

    @jax.jit
    def accuracy(state, inputs, labels):
        model, _ = nnx.merge(graphdef, state)
        return jnp.mean((model(inputs) > 0) == (labels == 1))

    start = time.perf_counter()
    for index in range(steps):
        state = train_step(state, batches_x, batches_y, index)
    jax.block_until_ready(state)
    seconds = time.perf_counter() - start
    print(f"final eval: accuracy {float(accuracy(state, eval_x, eval_y)):.4f}")
    print(f"trained {steps} steps in {seconds:.3f} s")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else STEPS)

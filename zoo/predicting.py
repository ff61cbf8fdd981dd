"""`zoo.predict`: a trained model's outputs for a batch of inputs, on its mesh, the inputs
checked first (`zoo.inputs.Reads`)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from zoo.engine import sharding
from zoo.inputs import Reads
from zoo.trained import Trained


@nnx.jit
def _forward(model: nnx.Module, inputs: jax.Array) -> Any:
    return model(inputs)


def predict(trained: Trained, inputs: np.ndarray) -> Any:
    """The model's outputs (logits; a tuple of arrays for a model that returns several, such as
    `vae`) for a batch of inputs as the model takes them (e.g. normalised float images,
    N x H x W x C: a data set's `transform` makes them), on the model's mesh.

    Inputs the model cannot take are refused by name before it runs (see `Reads`): strings
    and other non-numbers, one example without its batch axis, a shape or width it cannot
    take, raw integer pixels, token ids that are not integers of its vocabulary.
    A language model's logits have one column per token of its vocabulary (`vocab_size`)."""
    reads = Reads.of(trained.config)
    inputs = reads.check(inputs, "predict got inputs")
    if not reads.decides(inputs):
        graphdef, state = nnx.split(trained.model)
        with trained.activate():
            reads.check_traced(graphdef, state, inputs, "predict got inputs")
    shards = sharding.batch_divisor(trained.mesh, trained.rules)
    padding = -len(inputs) % shards
    padded = np.concatenate([inputs, np.repeat(inputs[-1:], padding, axis=0)])
    with trained.activate():
        batch = sharding.shard_batch({"inputs": padded}, trained.mesh, trained.rules)
        outputs = _forward(trained.model, batch["inputs"])
    outputs = jax.tree.map(lambda x: np.asarray(x)[: len(inputs)], jax.device_get(outputs))
    return within_vocabulary(trained.model, outputs)


def within_vocabulary(model: nnx.Module, outputs: Any) -> Any:
    """A language model's logits over its vocabulary alone: a model whose embedding has rows
    past its `vocab_size` (padded so that it shards) masks their logits, and they are dropped."""
    vocab = getattr(model, "vocab_size", None)
    if not isinstance(vocab, int) or not isinstance(outputs, np.ndarray | jax.Array):
        return outputs
    return outputs[..., :vocab] if outputs.ndim and outputs.shape[-1] > vocab else outputs

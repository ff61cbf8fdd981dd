"""A multi-layer perceptron classifier: flattened image -> hidden ReLU layers with Dropout -> logits.

The hidden layers are a `zoo.models.layers.dense_stack`: alternately column- and row-parallel, so
tensor parallelism needs one reduction per pair of layers and fsdp shards every kernel.
"""

from __future__ import annotations

import math

import jax
from flax import nnx
from zoo.models import hparams
from zoo.models.classification import classification_loss, report_classifier
from zoo.models.layers import dense, dense_stack, run_stack, split_by_fsdp, stack_output_axis

from zoo.plugin import logical_spec, register_model


@register_model(
    "mlp",
    loss=classification_loss,
    on_eval=report_classifier,
    default_data="digits",
    trainer={"steps": 3000, "batch_size": 64, "log_every": 100, "eval_every": 500},
    optimizer={"name": "adamw", "learning_rate": 1e-3, "schedule": "cosine", "warmup_steps": 100},
    tiny=("data=digits", "model.hidden_sizes=[32,32]"),
)
class MLP(nnx.Module):
    def __init__(
        self,
        input_shape: list[int] | None = None,  # shape of one input, flattened; null: the data set's
        num_classes: int | None = None,  # classes: the head's outputs; null: the data set's
        # Units of each hidden ReLU layer, first to last.
        hidden_sizes: list[int] = [256, 256, 256],  # noqa: B006  (a config default, never mutated)
        dropout_rate: float = 0.2,  # Dropout after each hidden layer
        *,
        rngs: nnx.Rngs,
    ):
        hparams.positive(
            "mlp", input_shape=input_shape, num_classes=num_classes, hidden_sizes=hidden_sizes
        )
        hparams.rates("mlp", dropout_rate=dropout_rate)
        sizes = [math.prod(input_shape), *hidden_sizes]
        self.hidden = dense_stack(sizes, rngs=rngs)
        # Module-bound: each Dropout keeps its own stream, carried in the state between steps.
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)
        last_axis = stack_output_axis(self.hidden)
        self.head = dense(sizes[-1], num_classes, (split_by_fsdp(last_axis), None), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = run_stack(self.hidden, x.reshape(x.shape[0], -1), lambda h: self.dropout(nnx.relu(h)))
        return self.head(h, out_sharding=logical_spec("batch", None))

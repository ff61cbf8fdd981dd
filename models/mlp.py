"""A multi-layer perceptron classifier: flattened image -> hidden ReLU layers with Dropout -> logits.

Hidden layers alternate column- and row-parallel (Megatron style): kernels (embed, mlp), then
(mlp, embed), so tensor parallelism needs one reduction per pair of layers and fsdp shards every
kernel.
"""

from __future__ import annotations

import itertools
import math

import jax
from flax import nnx

from models.classification import classification_loss, report_classifier
from models.layers import dense
from train.sharding import logical_spec
from zoo.registry import register_model


@register_model(
    "mlp",
    loss=classification_loss,
    on_eval=report_classifier,
    default_data="digits",
    trainer={"steps": 3000, "batch_size": 64, "log_every": 100, "eval_every": 500},
    optimizer={"name": "adamw", "learning_rate": 1e-3, "schedule": "cosine", "warmup_steps": 100},
)
class MLP(nnx.Module):
    def __init__(
        self,
        input_shape: list[int] | None = None,
        num_classes: int | None = None,
        hidden_sizes: list[int] = [256, 256, 256],  # noqa: B006  (a config default, never mutated)
        dropout_rate: float = 0.2,
        *,
        rngs: nnx.Rngs,
    ):
        sizes = [math.prod(input_shape), *hidden_sizes]
        self.hidden = nnx.List(
            [
                dense(din, dout, ("embed", "mlp") if i % 2 == 0 else ("mlp", "embed"), rngs=rngs)
                for i, (din, dout) in enumerate(itertools.pairwise(sizes))
            ]
        )
        # Module-bound: each Dropout keeps its own stream, carried in the state between steps.
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)
        last_axis = "mlp" if len(hidden_sizes) % 2 else "embed"
        self.head = dense(sizes[-1], num_classes, (last_axis, None), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.reshape(x.shape[0], -1)
        for i, layer in enumerate(self.hidden):
            # Row-parallel layers sum over tensor-sharded features: say where the sum lands.
            out = logical_spec("batch", "mlp" if i % 2 == 0 else None)
            h = self.dropout(nnx.relu(layer(h, out_sharding=out)))
        return self.head(h, out_sharding=logical_spec("batch", None))

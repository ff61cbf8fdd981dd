"""The continuous-XOR classifier: 2 -> 8 tanh -> 1 logit, binary cross-entropy."""

from __future__ import annotations

import jax.numpy as jnp
import optax
from flax import nnx
from zoo.models import hparams

from zoo.plugin import logical_spec, loss_contract, partitioned, register_model


@loss_contract(columns=("inputs", "label"), metrics=("accuracy",))
def binary_classification_loss(model: nnx.Module, batch, rngs: nnx.Rngs):
    logits = model(batch["inputs"])[:, 0].astype(jnp.float32)
    labels = batch["label"]
    loss = optax.sigmoid_binary_cross_entropy(logits, labels.astype(logits.dtype))
    accuracy = ((logits > 0) == (labels == 1)).astype(jnp.float32)
    return loss, {"accuracy": accuracy}


@register_model(
    "xor",
    loss=binary_classification_loss,
    default_data="xor",
    # The tutorial's recipe: SGD at 0.1, batch 128, about 100 epochs of the 2,500 training
    # points; 50 steps per dispatch, since one step takes the devices less time than the host
    # needs to launch it.
    trainer={"steps": 2000, "batch_size": 128, "log_every": 100, "steps_per_dispatch": 50},
    optimizer={"name": "sgd", "learning_rate": 0.1},
    tiny=("data.train_size=256", "data.eval_size=64"),
)
class XorClassifier(nnx.Module):
    def __init__(
        self,
        num_inputs: int = 2,  # input features: the width of the data's `inputs`
        num_hidden: int = 8,  # tanh hidden units
        num_outputs: int = 1,  # output logits (the loss reads the first)
        *,
        rngs: nnx.Rngs,
    ):
        hparams.positive(
            "xor", num_inputs=num_inputs, num_hidden=num_hidden, num_outputs=num_outputs
        )
        kernel, zeros = nnx.initializers.lecun_normal(), nnx.initializers.zeros_init()
        # Two input features are too few to split: tensor parallelism splits the hidden units,
        # and on an fsdp mesh this model is simply data parallel.
        self.hidden = nnx.Linear(
            num_inputs,
            num_hidden,
            kernel_init=partitioned(kernel, (None, "mlp")),
            bias_init=partitioned(zeros, ("mlp",)),
            rngs=rngs,
        )
        self.output = nnx.Linear(
            num_hidden,
            num_outputs,
            kernel_init=partitioned(kernel, ("mlp", None)),
            bias_init=partitioned(zeros, (None,)),
            rngs=rngs,
        )

    def __call__(self, x):
        h = nnx.tanh(self.hidden(x))
        # The contraction runs over the tensor-sharded hidden dim: say where the sum lands.
        return self.output(h, out_sharding=logical_spec("batch", None))

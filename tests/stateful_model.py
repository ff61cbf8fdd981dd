"""A test model with every kind of NNX state the trainer must carry: params, BatchNorm statistics
and a module-bound Dropout stream (RngState)."""

from __future__ import annotations

from flax import nnx
from zoo.engine.sharding.mesh import logical_spec
from zoo.models.xor import binary_classification_loss

import zoo

NAME = "test_dropout_bn"


class DropoutBatchNormNet(nnx.Module):
    def __init__(self, hidden: int = 16, rate: float = 0.3, embed: int = 0, *, rngs: nnx.Rngs):
        """`embed` > 0 puts a 2 -> embed projection first, whose output dim (and fc1's input
        dim) is the logical `embed` axis, sharded over the mesh's `fsdp` axis."""
        kernel, zeros, ones = (
            nnx.initializers.lecun_normal(),
            nnx.initializers.zeros_init(),
            nnx.initializers.ones_init(),
        )
        self.embed = nnx.data(None)
        if embed:
            self.embed = nnx.Linear(
                2,
                embed,
                use_bias=False,
                kernel_init=nnx.with_partitioning(kernel, (None, "embed")),
                rngs=rngs,
            )
        # No bias before BatchNorm: it would get a zero gradient, which Adam turns into noise
        # that differs between meshes.
        self.fc1 = nnx.Linear(
            embed or 2,
            hidden,
            use_bias=False,
            kernel_init=nnx.with_partitioning(kernel, ("embed", "mlp")),
            rngs=rngs,
        )
        self.bn = nnx.BatchNorm(
            hidden,
            scale_init=nnx.with_partitioning(ones, ("mlp",)),
            bias_init=nnx.with_partitioning(zeros, ("mlp",)),
            rngs=rngs,
        )
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.fc2 = nnx.Linear(
            hidden,
            1,
            kernel_init=nnx.with_partitioning(kernel, ("mlp", None)),
            bias_init=nnx.with_partitioning(zeros, (None,)),
            rngs=rngs,
        )

    def __call__(self, x):
        if self.embed is not None:
            # The batch is sharded over fsdp too, so the embed dim's sum lands unsharded.
            x = self.embed(x, out_sharding=logical_spec("batch", None))
        h = self.drop(nnx.relu(self.bn(self.fc1(x))))
        return self.fc2(h, out_sharding=logical_spec("batch", None))


if NAME not in zoo.list_models():
    zoo.register_model(
        NAME,
        DropoutBatchNormNet,
        loss=binary_classification_loss,
        default_data="xor",
        trainer={"steps": 60, "batch_size": 64, "log_every": 20},
        optimizer={"name": "adam", "learning_rate": 0.01},
    )

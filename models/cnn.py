"""A small convolutional classifier: conv-BatchNorm-ReLU stages, the later ones halving the
resolution with stride-2 convolutions, then Dropout and a linear head on the flattened features.

Stride-2 convolutions instead of max-pooling: XLA:CPU's max-pool backward pass is several times
slower than a strided convolution's. The head's size follows the data set's `input_shape`, so the
same model trains on 8x8 digits and on 28x28 Fashion-MNIST.

The Dropout stream is bound to the module at construction (`nnx.Dropout(rate, rngs=rngs)`): it
lives in the model's state as RngState, advances every step and is checkpointed with it.
"""

from __future__ import annotations

import itertools

import jax
from flax import nnx
from zoo.models import hparams
from zoo.models.classification import classification_loss, report_classifier
from zoo.models.layers import batch_norm, conv, dense, split_by_fsdp

from zoo.plugin import logical_spec, register_model


class ConvBlock(nnx.Module):
    """conv -> BatchNorm -> ReLU; output channels on the logical `conv_out` axis."""

    def __init__(self, cin: int, cout: int, strides: int, *, rngs: nnx.Rngs):
        self.conv = conv(cin, cout, 3, strides=strides, rngs=rngs)
        self.norm = batch_norm(cout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.conv(x, out_sharding=logical_spec("batch", None, None, "conv_out"))
        return nnx.relu(self.norm(h))


@register_model(
    "cnn",
    loss=classification_loss,
    on_eval=report_classifier,
    default_data="fashion_mnist",
    # Five epochs of Fashion-MNIST's 60,000 training images.
    trainer={"steps": 2350, "batch_size": 128, "log_every": 50, "eval_every": 470},
    optimizer={"name": "adamw", "learning_rate": 3e-3, "schedule": "cosine", "warmup_steps": 200},
    tiny=("data=digits", "model.channels=[8,16,16]"),
)
class CNN(nnx.Module):
    def __init__(
        self,
        input_shape: list[int] | None = None,  # `[height, width, channels]`; null: the data set's
        num_classes: int | None = None,  # classes: the head's outputs; null: the data set's
        # Output channels per conv stage; the first keeps the resolution, each later one halves it.
        channels: list[int] = [16, 32, 64],  # noqa: B006  (a config default, never mutated)
        dropout_rate: float = 0.3,  # Dropout on the flattened features before the head
        *,
        rngs: nnx.Rngs,
    ):
        hparams.positive("cnn", input_shape=input_shape, num_classes=num_classes, channels=channels)
        hparams.rates("cnn", dropout_rate=dropout_rate)
        # The first stage keeps the resolution; each later one halves it.
        widths = [input_shape[-1], *channels]
        self.blocks = nnx.List(
            [
                ConvBlock(cin, cout, 1 if i == 0 else 2, rngs=rngs)
                for i, (cin, cout) in enumerate(itertools.pairwise(widths))
            ]
        )
        self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)
        height, width = input_shape[0], input_shape[1]
        for _ in channels[1:]:
            height, width = -(-height // 2), -(-width // 2)
        # The flattened (height, width, channel) features are whole on each device: the
        # kernel's rows are split by FSDP alone.
        self.head = dense(
            height * width * channels[-1], num_classes, (split_by_fsdp(None), None), rngs=rngs
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        features = x.reshape(x.shape[0], -1, out_sharding=logical_spec("batch", None))
        return self.head(self.dropout(features), out_sharding=logical_spec("batch", None))

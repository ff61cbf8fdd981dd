"""A small Vision Transformer: non-overlapping patches -> linear embedding + learned positions ->
pre-norm transformer blocks (`models.transformer`: multi-head self-attention, GELU MLP) -> mean
over tokens -> logits.

Its randomness comes at call time: `model(images, rngs=rngs)`. The Dropout layers hold no stream
of their own; the trainer passes Rngs built from its base key and the step number, so every step
draws fresh masks, a rerun with the same seed draws the same ones, and a resumed run draws what
the uninterrupted run would have.
"""

from __future__ import annotations

import jax
from flax import nnx

from models import hparams
from models.classification import classification_loss_with_rngs, report_classifier
from models.layers import conv, dense, layer_norm
from models.transformer import Block, dropout_key
from train.errors import ZooError
from train.registry import register_model
from train.sharding import logical_spec


@register_model(
    "vit",
    loss=classification_loss_with_rngs,
    on_eval=report_classifier,
    default_data="fashion_mnist",
    # Seven and a half epochs of Fashion-MNIST: a transformer learns images more slowly than a
    # convolutional network, but its steps are cheaper.
    trainer={"steps": 3500, "batch_size": 128, "log_every": 50, "eval_every": 700},
    optimizer={
        "name": "adamw",
        "learning_rate": 2e-3,
        "schedule": "cosine",
        "warmup_steps": 300,
        "weight_decay": 0.05,
        "grad_clip_norm": 1.0,
    },
)
class ViT(nnx.Module):
    def __init__(
        self,
        input_shape: list[int] | None = None,
        num_classes: int | None = None,
        patch_size: int = 7,
        dim: int = 64,
        depth: int = 4,
        num_heads: int = 4,
        mlp_ratio: int = 2,
        dropout_rate: float = 0.1,
        *,
        rngs: nnx.Rngs,
    ):
        hparams.positive(
            "vit",
            input_shape=input_shape,
            num_classes=num_classes,
            patch_size=patch_size,
            dim=dim,
            depth=depth,
            num_heads=num_heads,
            mlp_ratio=mlp_ratio,
        )
        hparams.rates("vit", dropout_rate=dropout_rate)
        height, width, channels = input_shape
        if height % patch_size or width % patch_size or dim % num_heads:
            raise ZooError(
                f"vit: {height}x{width} images do not split into {patch_size}x{patch_size} "
                f"patches, or dim={dim} is not a multiple of num_heads={num_heads}. Choose "
                f"model.patch_size dividing both {height} and {width}, and model.dim divisible "
                "by model.num_heads."
            )
        num_patches = (height // patch_size) * (width // patch_size)
        # A patch_size-strided convolution is the patch embedding: one linear map per patch.
        self.embed = conv(
            channels,
            dim,
            patch_size,
            strides=patch_size,
            padding="VALID",
            use_bias=True,
            out_axis="embed",
            rngs=rngs,
        )
        self.positions = nnx.Param(
            nnx.with_partitioning(nnx.initializers.normal(0.02), (None, None))(
                rngs.params(), (num_patches, dim)
            )
        )
        self.blocks = nnx.List(
            [
                Block(
                    dim,
                    num_heads,
                    mlp_ratio,
                    dropout_rate,
                    attention_dropout=dropout_rate,
                    rngs=rngs,
                )
                for _ in range(depth)
            ]
        )
        self.dropout_rate = dropout_rate
        self.norm = layer_norm(dim, rngs=rngs)
        self.head = dense(dim, num_classes, (None, None), rngs=rngs)

    def __call__(self, x: jax.Array, *, rngs: nnx.Rngs | None = None) -> jax.Array:
        patches = self.embed(x, out_sharding=logical_spec("batch", None, None, None))
        tokens = patches.reshape(x.shape[0], -1, patches.shape[-1]) + self.positions[...]
        deterministic = self.blocks[0].dropout.deterministic
        key = dropout_key(rngs, self.dropout_rate, deterministic, "vit")
        for block, block_key in zip(
            self.blocks, jax.random.split(key, len(self.blocks)), strict=True
        ):
            tokens, _ = block(tokens, block_key)
        return self.head(self.norm(tokens).mean(axis=1), out_sharding=logical_spec("batch", None))

"""A small Vision Transformer: non-overlapping patches -> linear embedding + learned positions ->
pre-norm transformer blocks (multi-head self-attention, GELU MLP) -> mean over tokens -> logits.

Its randomness comes at call time: `model(images, rngs=rngs)`. The Dropout layers hold no stream
of their own; the trainer passes Rngs built from its base key and the step number, so every step
draws fresh masks, a rerun with the same seed draws the same ones, and a resumed run draws what
the uninterrupted run would have.

Attention is written out (three projections and two einsums) rather than taken from
`nnx.MultiHeadAttention`, so each contraction can say where its output lives: heads are split
over the `tensor` mesh axis, and explicit sharding needs the output projection's sum over heads
placed explicitly.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models.classification import classification_loss_with_rngs, report_classifier
from models.layers import conv, dense, head_projections, layer_norm
from train.sharding import logical_spec
from zoo.errors import ZooError
from zoo.registry import register_model


def _tokens():
    return logical_spec("batch", None, None)


class SelfAttention(nnx.Module):
    def __init__(self, dim: int, num_heads: int, dropout_rate: float, *, rngs: nnx.Rngs):
        self.query, self.key, self.value, self.out = head_projections(dim, num_heads, rngs=rngs)
        self.dropout = nnx.Dropout(dropout_rate)

    def __call__(self, x: jax.Array, rngs: nnx.Rngs | None) -> jax.Array:
        heads = logical_spec("batch", None, "heads", None)
        q, k, v = (proj(x, out_sharding=heads) for proj in (self.query, self.key, self.value))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
        weights = self.dropout(jax.nn.softmax(logits, axis=-1), rngs=rngs)
        mixed = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        return self.out(mixed, out_sharding=_tokens())


class EncoderBlock(nnx.Module):
    """x + attention(norm(x)), then x + mlp(norm(x)): pre-norm, which trains stably without
    warm-up tricks at small sizes. Dropout acts on the attention weights and on each branch's
    output, not on the wider MLP hidden layer: random bits cost about 25 ns each on a CPU, and
    a dropout layer there would add half again to the step time."""

    def __init__(
        self, dim: int, num_heads: int, mlp_ratio: int, dropout_rate: float, *, rngs: nnx.Rngs
    ):
        self.attention_norm = layer_norm(dim, rngs=rngs)
        self.attention = SelfAttention(dim, num_heads, dropout_rate, rngs=rngs)
        self.mlp_norm = layer_norm(dim, rngs=rngs)
        self.mlp_in = dense(dim, dim * mlp_ratio, ("embed", "mlp"), rngs=rngs)
        self.mlp_out = dense(dim * mlp_ratio, dim, ("mlp", "embed"), rngs=rngs)
        self.dropout = nnx.Dropout(dropout_rate)

    def __call__(self, x: jax.Array, rngs: nnx.Rngs | None) -> jax.Array:
        x = x + self.dropout(self.attention(self.attention_norm(x), rngs), rngs=rngs)
        h = self.mlp_in(self.mlp_norm(x), out_sharding=logical_spec("batch", None, "mlp"))
        return x + self.dropout(self.mlp_out(nnx.gelu(h), out_sharding=_tokens()), rngs=rngs)


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
            [EncoderBlock(dim, num_heads, mlp_ratio, dropout_rate, rngs=rngs) for _ in range(depth)]
        )
        self.norm = layer_norm(dim, rngs=rngs)
        self.head = dense(dim, num_classes, (None, None), rngs=rngs)

    def __call__(self, x: jax.Array, *, rngs: nnx.Rngs | None = None) -> jax.Array:
        patches = self.embed(x, out_sharding=logical_spec("batch", None, None, None))
        tokens = patches.reshape(x.shape[0], -1, patches.shape[-1]) + self.positions[...]
        for block in self.blocks:
            tokens = block(tokens, rngs)
        return self.head(self.norm(tokens).mean(axis=1), out_sharding=logical_spec("batch", None))

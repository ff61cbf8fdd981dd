"""SigLIP (transformers' `SiglipModel`): an image tower and a text tower whose L2-normalised
embeddings meet in one space, scored pair by pair with a sigmoid, so that each label is a yes or
no of its own (zero-shot classification without a softmax over the labels).

Image tower: non-overlapping patches -> linear embedding + learned positions (no class token)
-> pre-norm blocks (`zoo.models.transformer.Block`: biased attention, tanh GELU, LayerNorm eps
1e-6) -> final LayerNorm -> attention pooling (`MapHead`: one learned query, a probe, attends to
every token, then an MLP added back) -> the image's embedding. Text tower: token embedding +
learned positions -> the same blocks, bidirectional, padding keys hidden where a mask is given
-> final LayerNorm -> the **last** position (SigLIP's texts are padded to a fixed length, so it
is a padding token's) -> a linear projection. Both embeddings are divided by their L2 norm;
`logits = image . text * exp(logit_scale) + logit_bias`, probabilities their sigmoid.

`model(pixels)` gives the images' normalised embeddings (pixels as the image processor makes
them, in [-1, 1]); `model.embed_texts(ids, mask)` the texts'; `model.logits(pixels, ids, mask)`
the image x text logits. Loading, export and the key table: `zoo.models.siglip_params`.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from zoo.models import hparams
from zoo.models.layers import dense, head_projections, layer_norm, learned
from zoo.models.transformer import Block, BlockOptions, tokens_spec
from zoo.models.vit import patch_embedding

from zoo.plugin import (
    ZooError,
    attend,
    logical_spec,
    loss_contract,
    partitioned,
    register_model,
    repeated,
)

TOKENS = "tokens"
"""The batch column of the texts' token ids that SigLIP's sigmoid loss pairs with `image`."""


class Tower(nnx.Module):
    """The blocks both towers share: `depth` non-causal pre-norm blocks, then a LayerNorm."""

    def __init__(self, dim: int, depth: int, heads: int, options: BlockOptions, rngs: nnx.Rngs):
        def block(_):
            return Block(dim, heads, options.mlp_ratio, 0.0, options=options, rngs=rngs)

        self.blocks = nnx.List(repeated(block, depth))
        self.norm = layer_norm(dim, rngs=rngs, epsilon=options.norm_epsilon)

    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        key = jax.random.key(0)  # no Dropout: SigLIP's rates are 0
        for block in self.blocks:
            x, _ = block(x, key, mask=mask)
        return self.norm(x)


class MapHead(nnx.Module):
    """Multi-head attention pooling (`SiglipMultiheadAttentionPoolingHead`): a learned probe
    attends to every token (biased projections, no mask), then `x + mlp(norm(x))`."""

    def __init__(self, dim: int, heads: int, options: BlockOptions, rngs: nnx.Rngs):
        self.probe = learned((dim,), (None,), rngs=rngs)
        self.query, self.key, self.value, self.out = head_projections(
            dim, heads, rngs=rngs, use_bias=True
        )
        self.norm = layer_norm(dim, rngs=rngs, epsilon=options.norm_epsilon)
        hidden = options.mlp_dim or int(dim * options.mlp_ratio)
        self.mlp_in = dense(dim, hidden, ("embed", "mlp"), rngs=rngs)
        self.mlp_out = dense(hidden, dim, ("mlp", "embed"), rngs=rngs)
        self.exact_gelu = options.exact_gelu

    def __call__(self, tokens: jax.Array) -> jax.Array:
        heads = logical_spec("batch", None, "heads", None)
        probe = jnp.zeros_like(tokens[:, :1]) + self.probe[...]  # keeps the batch's sharding
        q = self.query(probe, out_sharding=heads)
        k, v = (proj(tokens, out_sharding=heads) for proj in (self.key, self.value))
        x = self.out(attend(q, k, v), out_sharding=tokens_spec())
        h = self.mlp_in(self.norm(x), out_sharding=logical_spec("batch", None, "mlp"))
        h = nnx.gelu(h, approximate=not self.exact_gelu)
        return (x + self.mlp_out(h, out_sharding=tokens_spec()))[:, 0]


@loss_contract(("image", TOKENS))
def sigmoid_loss(
    model: Siglip, batch: Mapping[str, jax.Array], rngs: nnx.Rngs
) -> tuple[jax.Array, dict]:
    """SigLIP's pairwise sigmoid loss, per image: `-sum_j log sigmoid(z_ij * logits_ij)`, z = +1
    for the image's own text (row i of `tokens`) and -1 for every other (its mean over the batch
    is transformers' `return_loss`). The texts are unmasked: padding with the end token, as
    SigLIP was trained."""
    logits = model.logits(batch["image"], batch[TOKENS])
    signs = 2 * jnp.eye(logits.shape[0], dtype=logits.dtype) - 1
    loss = -jax.nn.log_sigmoid(signs * logits).sum(axis=1)
    return loss, {}


@register_model(
    "siglip",
    loss=sigmoid_loss,
    default_data="shape_captions",
    trainer={"steps": 1000, "batch_size": 64, "log_every": 50, "eval_every": 250},
    optimizer={"name": "adamw", "learning_rate": 1e-3, "weight_decay": 0.05},
    tiny=(
        "data=shape_captions",
        "model.patch_size=4",
        "model.vision_dim=16",
        "model.vision_depth=1",
        "model.vision_heads=2",
        "model.vision_mlp_dim=32",
        "model.vocab_size=8",
        "model.context_length=4",
        "model.text_dim=16",
        "model.text_depth=1",
        "model.text_heads=2",
        "model.text_mlp_dim=32",
        "model.projection_dim=16",
    ),
)
class Siglip(nnx.Module):
    def __init__(
        self,
        input_shape: list[int] | None = None,  # `[height, width, channels]` of the images
        patch_size: int = 4,  # side of the square patches, in pixels
        vision_dim: int = 64,  # width of the image tower's tokens
        vision_depth: int = 2,  # the image tower's blocks
        vision_heads: int = 4,  # the image tower's attention heads
        vision_mlp_dim: int = 256,  # each image block's MLP hidden width
        vocab_size: int = 8,  # the text tower's vocabulary (shape_captions' by default)
        context_length: int = 4,  # the text positions held: the longest text it reads
        text_dim: int = 64,  # width of the text tower's tokens
        text_depth: int = 2,  # the text tower's blocks
        text_heads: int = 4,  # the text tower's attention heads
        text_mlp_dim: int = 256,  # each text block's MLP hidden width
        projection_dim: int = 64,  # width of the text embedding (the image tower's width)
        norm_epsilon: float = 1e-6,  # epsilon of every LayerNorm
        exact_gelu: bool = False,  # the MLPs' exact (erf) GELU instead of its tanh approximation
        *,
        rngs: nnx.Rngs,
    ):
        """A SigLIP of these sizes (each a `model.*` key), checked first; its params drawn from
        `rngs` in a fixed order: the image tower, its head, the text tower, its projection, the
        logit scale and bias."""
        input_shape = input_shape or [16, 16, 3]
        _check(input_shape, patch_size, vision_dim, vision_heads, text_dim, text_heads)
        if projection_dim != vision_dim:
            raise ZooError(
                f"siglip: model.projection_dim={projection_dim} must equal model.vision_dim="
                f"{vision_dim}: the text embedding is scored against the image's."
            )
        height, width, channels = input_shape
        vision = BlockOptions(4, True, norm_epsilon, exact_gelu, mlp_dim=vision_mlp_dim)
        text = BlockOptions(4, True, norm_epsilon, exact_gelu, mlp_dim=text_mlp_dim)
        grid = (height // patch_size) * (width // patch_size)
        self.embed = patch_embedding(channels, vision_dim, patch_size, rngs)
        self.positions = learned((grid, vision_dim), (None, "embed"), rngs=rngs)
        self.vision = Tower(vision_dim, vision_depth, vision_heads, vision, rngs)
        self.head = MapHead(vision_dim, vision_heads, vision, rngs)
        self.token_embedding = learned((vocab_size, text_dim), ("vocab", "embed"), rngs=rngs)
        self.text_positions = learned((context_length, text_dim), (None, "embed"), rngs=rngs)
        self.text = Tower(text_dim, text_depth, text_heads, text, rngs)
        self.projection = dense(text_dim, projection_dim, ("embed", None), rngs=rngs)
        self.logit_scale = _scalar(jnp.log(10.0), rngs)  # SigLIP's initial temperature
        self.logit_bias = _scalar(-10.0, rngs)
        self.vocab_size, self.context_length = vocab_size, context_length
        self.image_size = (height, width)

    def __call__(self, pixels: jax.Array) -> jax.Array:
        """The images' L2-normalised embeddings (images x vision_dim)."""
        return _normalised(self.embed_images(pixels))

    def embed_images(self, pixels: jax.Array) -> jax.Array:
        """The image tower's pooled output (`image_embeds` before normalising)."""
        patches = self.embed(pixels, out_sharding=logical_spec("batch", None, None, None))
        tokens = patches.reshape(pixels.shape[0], -1, patches.shape[-1])
        table = jax.sharding.reshard(self.positions[...], logical_spec(None, None))
        return self.head(self.vision(tokens + table))

    def embed_texts(self, ids: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        """The texts' projected last-position outputs (`text_embeds` before normalising);
        `mask` (texts x length, 1 for a real token): padding keys are hidden from every query,
        as transformers does with the tokenizer's `attention_mask`."""
        table = jax.sharding.reshard(self.token_embedding[...], logical_spec(None, None))
        positions = jax.sharding.reshard(self.text_positions[...], logical_spec(None, None))
        x = table.at[ids].get(out_sharding=tokens_spec()) + positions[: ids.shape[1]]
        visible = None if mask is None else (mask[:, None, None, :] > 0)
        out = self.text(x, visible)
        return self.projection(out[:, -1], out_sharding=logical_spec("batch", None))

    def logits(self, pixels: jax.Array, ids: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        """Images x texts: `image . text * exp(logit_scale) + logit_bias` of the normalised
        embeddings (`logits_per_image`)."""
        images = _normalised(self.embed_images(pixels))
        texts = _normalised(self.embed_texts(ids, mask))
        texts = jax.sharding.reshard(texts, logical_spec(None, None))  # every image sees all
        return images @ texts.T * jnp.exp(self.logit_scale[...]) + self.logit_bias[...]


def _scalar(value: float, rngs: nnx.Rngs) -> nnx.Param:
    """A learned (1,) param starting at `value`, whole on every device."""
    init = nnx.initializers.constant(value)
    return nnx.Param(partitioned(init, (None,))(rngs.params(), (1,)))


def _normalised(x: jax.Array) -> jax.Array:
    """x divided by its L2 norm, as transformers divides (not times a reciprocal root)."""
    return x / jnp.linalg.norm(x, axis=-1, keepdims=True)


def _check(
    input_shape: list[int], patch: int, vision_dim: int, vision_heads: int, dim: int, heads: int
) -> None:
    """Every size at least 1, the images split into patches, the heads splitting the widths."""
    hparams.positive("siglip", input_shape=input_shape, patch_size=patch, vision_dim=vision_dim)
    height, width, _ = input_shape
    if height % patch or width % patch or vision_dim % vision_heads or dim % heads:
        raise ZooError(
            f"siglip: {height}x{width} images must split into {patch}x{patch} patches, and each "
            f"tower's heads must divide its width (vision {vision_dim}/{vision_heads}, text "
            f"{dim}/{heads})."
        )

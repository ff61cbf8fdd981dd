"""A small Vision Transformer: non-overlapping patches -> linear embedding + learned positions ->
pre-norm transformer blocks (`zoo.models.transformer`: multi-head self-attention, GELU MLP) -> mean
over tokens -> logits.

The options that pretrained ViTs (Hugging Face's, timm's, SigLIP's vision tower;
`zoo.models.vit_params`) differ in: `class_token` (a learned token before the patches) and
`pool=cls` (its output is the image's), or `pool=mean` over the patches (SigLIP's classifier: no
class token, the mean of the normed tokens); `norm_after_pool` (timm's `fc_norm`: the final
LayerNorm of the pooled vector instead of every token's); the block's `attention_bias`,
`norm_epsilon`, `exact_gelu` and MLP width (`mlp_ratio`, or `mlp_dim` where a checkpoint's is no
whole multiple of `dim`). `position_grid` is the patch grid the learned positions are held for (a
checkpoint's): images of another size get them resized bicubically on every call, as Hugging
Face's `interpolate_pos_encoding` (`position_resize=bicubic`) or timm's `resample_abs_pos_embed`
(`bicubic_antialias`) does. `pixel_mean`/`pixel_std` make the model
normalise its inputs, as pretrained weights expect: give it pixels in [0, 1].

Its randomness comes at call time: `model(images, rngs=rngs)`. The Dropout layers hold no stream
of their own; the trainer passes Rngs built from its base key and the step number, so every step
draws fresh masks, a rerun with the same seed draws the same ones, and a resumed run draws what
the uninterrupted run would have.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from zoo.models import hparams, positions
from zoo.models.classification import classification_loss_with_rngs, report_classifier
from zoo.models.layers import conv, dense, layer_norm, learned, split_by_fsdp
from zoo.models.transformer import Block, BlockOptions, dropout_key

from zoo.plugin import ZooError, logical_spec, register_model, repeated


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
    tiny=(
        "data=digits",
        "model.patch_size=2",
        "model.dim=16",
        "model.depth=2",
        "model.num_heads=2",
    ),
)
class ViT(nnx.Module):
    def __init__(
        self,
        input_shape: list[int] | None = None,  # `[height, width, channels]`; null: the data set's
        num_classes: int | None = None,  # classes: the head's outputs; null: the data set's
        # Side of the square patches, in pixels: it must divide the images' sides.
        patch_size: int = 7,
        dim: int = 64,  # width of the tokens: the patch embedding and every block
        depth: int = 4,  # transformer blocks
        num_heads: int = 4,  # attention heads: they must divide `dim`
        mlp_ratio: int = 2,  # each block's MLP hidden width, as a multiple of `dim`
        # Each block's MLP hidden width, in place of mlp_ratio's: a checkpoint's width that is
        # no whole multiple of `dim`, as SigLIP's; 0: `mlp_ratio` times `dim`.
        mlp_dim: int = 0,
        # Dropout on each block's attention weights and on its attention and MLP outputs (0 puts
        # training on a fused attention path).
        dropout_rate: float = 0.1,
        class_token: bool = False,  # a learned token before the patches (`pool=cls` reads it)
        # The vector the head reads: `mean` over the patch tokens, or `cls`: the class token's
        # output (needs class_token=true).
        pool: str = "mean",
        # The final LayerNorm normalises the pooled vector (timm's `fc_norm`) instead of every
        # token.
        norm_after_pool: bool = False,
        # Biases on attention's query, key, value and output projections.
        attention_bias: bool = False,
        norm_epsilon: float = 1e-6,  # epsilon of every LayerNorm
        exact_gelu: bool = False,  # the MLP's exact (erf) GELU instead of its tanh approximation
        # [rows, columns] of patches that the learned positions are held for (a checkpoint's);
        # images of another patch grid get them resized on every call. null: the images' own grid.
        position_grid: list[int] | None = None,
        # How the positions are resized: `bicubic` (Hugging Face's `interpolate_pos_encoding`) or
        # `bicubic_antialias` (timm's `resample_abs_pos_embed`).
        position_resize: str = "bicubic",
        # Per-channel mean that the model subtracts from its inputs itself, `(x - mean) / std`, as
        # pretrained weights expect (give it pixels in [0, 1]); null (with pixel_std): inputs as
        # they come.
        pixel_mean: list[float] | None = None,
        # Per-channel std it divides by: one value per input channel, as pixel_mean.
        pixel_std: list[float] | None = None,
        *,
        rngs: nnx.Rngs,
    ):
        """A ViT of these options (each a `model.*` key), checked first, its params drawn from
        `rngs` in a fixed order: the patch embedding, the positions, the class token, the
        blocks, the final norm, the head."""
        _check_options(
            input_shape, num_classes, patch_size, dim, depth, num_heads, mlp_ratio, dropout_rate
        )
        _check_mlp_dim(mlp_dim)
        _check_choices(pool, position_resize, class_token)
        self.pixel_mean, self.pixel_std = hparams.pixel_statistics(
            pixel_mean, pixel_std, input_shape
        )
        height, width, channels = input_shape
        grid = _position_grid(height, width, patch_size, dim, num_heads, position_grid)
        self.patch_size, self.position_resize = patch_size, position_resize
        self.prefix = int(class_token)  # tokens before the patches
        self.embed = patch_embedding(channels, dim, patch_size, rngs)
        self.positions = learned((self.prefix + grid[0] * grid[1], dim), (None, "embed"), rngs=rngs)
        self.position_grid = tuple(grid)
        self.input_grid = (height // patch_size, width // patch_size)
        self.class_token = learned((dim,), (None,), rngs=rngs) if class_token else nnx.data(None)
        options = BlockOptions(mlp_ratio, attention_bias, norm_epsilon, exact_gelu, mlp_dim=mlp_dim)
        self.blocks = _blocks(dim, num_heads, depth, dropout_rate, options, rngs)
        self.dropout_rate = dropout_rate
        self.pool, self.norm_after_pool = pool, norm_after_pool
        self.norm = layer_norm(dim, rngs=rngs, epsilon=norm_epsilon)
        self.head = dense(dim, num_classes, (split_by_fsdp(None), None), rngs=rngs)

    def __call__(self, x: jax.Array, *, rngs: nnx.Rngs | None = None) -> jax.Array:
        if self.pixel_mean is not None:
            x = (x - jnp.asarray(self.pixel_mean, x.dtype)) / jnp.asarray(self.pixel_std, x.dtype)
        patches = self.embed(x, out_sharding=logical_spec("batch", None, None, None))
        tokens = patches.reshape(x.shape[0], -1, patches.shape[-1])
        if self.class_token is not None:  # zeros_like keeps the batch's sharding
            first = jnp.zeros_like(tokens[:, :1]) + self.class_token[...]
            tokens = jnp.concatenate([first, tokens], axis=1)
        tokens = tokens + self._positions(patches.shape[1:3])
        deterministic = self.blocks[0].dropout.deterministic
        key = dropout_key(rngs, self.dropout_rate, deterministic, "vit")
        for block, block_key in zip(
            self.blocks, jax.random.split(key, len(self.blocks)), strict=True
        ):
            tokens, _ = block(tokens, block_key)
        if self.norm_after_pool:
            pooled = self.norm(self._pooled(tokens))
        else:
            pooled = self._pooled(self.norm(tokens))
        return self.head(pooled, out_sharding=logical_spec("batch", None))

    def _positions(self, grid: tuple[int, int]) -> jax.Array:
        """The learned positions of the prefix tokens and of a `grid` of patches, whole on every
        device (FSDP stores them split; the batch-sharded tokens they are added to use `fsdp`)."""
        table = jax.sharding.reshard(self.positions[...], logical_spec(None, None))
        if tuple(grid) == self.position_grid:
            return table
        held = table[self.prefix :].reshape(*self.position_grid, -1)
        resized = positions.resize(held, grid, self.position_resize)
        return jnp.concatenate([table[: self.prefix], resized.reshape(-1, table.shape[-1])])

    def hold_positions_at_input_size(self) -> tuple[int, int]:
        """Replace the held positions by those the model computes with at its input size
        (resized once, as each call would): an export then holds what the model computes,
        at a grid that its config can name. Returns that grid."""
        if self.input_grid != self.position_grid:
            self.positions.set_value(self._positions(self.input_grid))
            self.position_grid = self.input_grid
        return self.input_grid

    def _pooled(self, tokens: jax.Array) -> jax.Array:
        return tokens[:, 0] if self.pool == "cls" else tokens[:, self.prefix :].mean(axis=1)


def _check_options(
    input_shape: list[int] | None,
    num_classes: int | None,
    patch_size: int,
    dim: int,
    depth: int,
    num_heads: int,
    mlp_ratio: int,
    dropout_rate: float,
) -> None:
    """Every size at least 1 (the data set's `input_shape` and `num_classes` given), the
    dropout rate in [0, 1)."""
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


def _check_mlp_dim(mlp_dim: int) -> None:
    """`mlp_dim` a width of at least 1, or 0 for `mlp_ratio`'s."""
    if not isinstance(mlp_dim, int) or mlp_dim < 0:
        raise ZooError(
            f"model.mlp_dim={mlp_dim} must be a width of at least 1, or 0 for mlp_ratio's (vit)."
        )


def _check_choices(pool: str, position_resize: str, class_token: bool) -> None:
    """`pool` and `position_resize` among their choices; `pool=cls` with a class token."""
    hparams.choice(
        "vit", pool=(pool, ("mean", "cls")), position_resize=(position_resize, positions.MODES)
    )
    if pool == "cls" and not class_token:
        raise ZooError("vit: model.pool=cls needs model.class_token=true.")


def _position_grid(
    height: int, width: int, patch_size: int, dim: int, num_heads: int, grid: list[int] | None
) -> list[int]:
    """The [rows, columns] of patches the learned positions are held for: `grid`, or the
    images' own; an error where the images do not split into patches or the heads do not
    split `dim`."""
    if height % patch_size or width % patch_size or dim % num_heads:
        raise ZooError(
            f"vit: {height}x{width} images do not split into {patch_size}x{patch_size} "
            f"patches, or dim={dim} is not a multiple of num_heads={num_heads}. Choose "
            f"model.patch_size dividing both {height} and {width}, and model.dim divisible "
            "by model.num_heads."
        )
    grid = grid or [height // patch_size, width // patch_size]
    hparams.positive("vit", position_grid=grid)
    return grid


def patch_embedding(channels: int, dim: int, patch_size: int, rngs: nnx.Rngs) -> nnx.Conv:
    """A patch_size-strided convolution: one linear map of each patch to a `dim`-wide token."""
    return conv(
        channels,
        dim,
        patch_size,
        strides=patch_size,
        padding="VALID",
        use_bias=True,
        in_axis=None,
        out_axis="embed",
        rngs=rngs,
    )


def _blocks(
    dim: int,
    num_heads: int,
    depth: int,
    dropout_rate: float,
    options: BlockOptions,
    rngs: nnx.Rngs,
) -> nnx.List:
    """`depth` transformer blocks, drawn from `rngs` one after another; `dropout_rate` on their
    attention weights too."""
    return nnx.List(
        repeated(
            lambda _: Block(
                dim,
                num_heads,
                options.mlp_ratio,
                dropout_rate,
                attention_dropout=dropout_rate,
                options=options,
                rngs=rngs,
            ),
            depth,
        )
    )

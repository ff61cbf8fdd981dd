"""ResNet: a stem, four stages of residual blocks (widths w, 2w, 4w, 8w; bottleneck blocks
output four times that), global average pooling, a linear head.

Two shapes of it. The default is for small images: a 3x3 stem, no max-pool, basic blocks;
`width=64 stem_strides=1` is the standard small-image ResNet-18 (11M params), and the default is
narrower and its stem halves the resolution, so that it trains to its accuracy on a 2-core CPU
in minutes. `stem=imagenet block=... padding=symmetric` is the ImageNet ResNet of torchvision,
timm and Hugging Face (7x7 stride-2 stem and 3x3 stride-2 max-pool; `stage_sizes` [2, 2, 2, 2]
basic is -18, [3, 4, 6, 3] basic -34, [3, 4, 6, 3] bottleneck -50), which `zoo.models.resnet_params`
loads pretrained weights into.

`padding=symmetric` pads every convolution by kernel_size // 2 on both sides, as torch does;
SAME pads a strided convolution by (0, 1), which shifts every strided layer's sampling grid by
a pixel against weights trained in torch. `pixel_mean`/`pixel_std` (per channel) make the model
normalise its inputs itself, `(x - mean) / std`, as pretrained weights expect: give such a model
pixel intensities in [0, 1] (`data.normalize=false`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from zoo.models import hparams
from zoo.models.classification import classification_loss, report_classifier
from zoo.models.layers import batch_norm, conv, dense, split_by_fsdp

from zoo.plugin import logical_spec, register_model, repeated

BLOCKS = ("basic", "bottleneck")
STEMS = ("small", "imagenet")
PADDINGS = ("same", "symmetric")
BOTTLENECK_EXPANSION = 4
"""A bottleneck block outputs this many times its stage's width."""


def _feature_map():
    return logical_spec("batch", None, None, "conv_out")


def _conv(cin: int, cout: int, kernel_size: int, strides: int, padding: str, rngs: nnx.Rngs):
    """A convolution padded as `padding` says: SAME, or kernel_size // 2 on every side."""
    pad = kernel_size // 2
    explicit = "SAME" if padding == "same" else ((pad, pad), (pad, pad))
    return conv(cin, cout, kernel_size, strides=strides, padding=explicit, rngs=rngs)


class BasicBlock(nnx.Module):
    """Two 3x3 convolutions with a residual connection, projected (1x1, strided) when the shape
    changes. The second BatchNorm starts at zero, so each block starts as the identity: deep
    stacks train from the first step."""

    def __init__(self, cin: int, width: int, strides: int, padding: str, *, rngs: nnx.Rngs):
        self.conv1 = _conv(cin, width, 3, strides, padding, rngs)
        self.norm1 = batch_norm(width, rngs=rngs)
        self.conv2 = _conv(width, width, 3, 1, padding, rngs)
        self.norm2 = batch_norm(width, rngs=rngs, zero_scale=True)
        self.project, self.project_norm = _projection(cin, width, strides, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = nnx.relu(self.norm1(self.conv1(x, out_sharding=_feature_map())))
        h = self.norm2(self.conv2(h, out_sharding=_feature_map()))
        return nnx.relu(h + _shortcut(self, x))


class Bottleneck(nnx.Module):
    """1x1 down to the stage's width, 3x3 (strided: torchvision's "v1.5"), 1x1 up to four times
    the width, with a residual connection; the last BatchNorm starts at zero."""

    def __init__(self, cin: int, width: int, strides: int, padding: str, *, rngs: nnx.Rngs):
        cout = width * BOTTLENECK_EXPANSION
        self.conv1 = _conv(cin, width, 1, 1, padding, rngs)
        self.norm1 = batch_norm(width, rngs=rngs)
        self.conv2 = _conv(width, width, 3, strides, padding, rngs)
        self.norm2 = batch_norm(width, rngs=rngs)
        self.conv3 = _conv(width, cout, 1, 1, padding, rngs)
        self.norm3 = batch_norm(cout, rngs=rngs, zero_scale=True)
        self.project, self.project_norm = _projection(cin, cout, strides, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = nnx.relu(self.norm1(self.conv1(x, out_sharding=_feature_map())))
        h = nnx.relu(self.norm2(self.conv2(h, out_sharding=_feature_map())))
        h = self.norm3(self.conv3(h, out_sharding=_feature_map()))
        return nnx.relu(h + _shortcut(self, x))


def _projection(cin: int, cout: int, strides: int, rngs: nnx.Rngs):
    """The shortcut's 1x1 strided convolution and its BatchNorm where the block changes the
    shape (a 1x1 convolution pads nothing either way), else (None, None)."""
    if strides == 1 and cin == cout:
        return nnx.data(None), nnx.data(None)
    return conv(cin, cout, 1, strides=strides, rngs=rngs), batch_norm(cout, rngs=rngs)


def _shortcut(block: BasicBlock | Bottleneck, x: jax.Array) -> jax.Array:
    if block.project is None:
        return x
    return block.project_norm(block.project(x, out_sharding=_feature_map()))


@register_model(
    "resnet",
    loss=classification_loss,
    on_eval=report_classifier,
    default_data="fashion_mnist",
    # Six epochs of Fashion-MNIST's 60,000 training images. Batches of 64 beat batches of 128
    # over the same epochs here (91.95% against 91.7% at width 12), at the same images/s.
    trainer={"steps": 5600, "batch_size": 64, "log_every": 100, "eval_every": 1400},
    # It overfits Fashion-MNIST within a few epochs (96% train, 91.5% test without decay);
    # neither flips (91.6%) nor label smoothing (91.6%) helped within six epochs.
    optimizer={
        "name": "adamw",
        "learning_rate": 2e-3,
        "schedule": "cosine",
        "warmup_steps": 400,
        "weight_decay": 0.05,
    },
    tiny=("data=digits", "model.width=8", "model.stage_sizes=[1,1]"),
)
class ResNet(nnx.Module):
    def __init__(
        self,
        input_shape: list[int] | None = None,  # `[height, width, channels]`; null: the data set's
        num_classes: int | None = None,  # classes: the head's outputs; null: the data set's
        width: int = 16,  # channels of the stem and the first stage; each later stage doubles them
        # Residual blocks per stage, one entry per stage, each stage after the first halving the
        # resolution: [2, 2, 2, 2] is ResNet-18's, [3, 4, 6, 3] -34's (-50's with bottleneck
        # blocks).
        stage_sizes: list[int] = [2, 2, 2, 2],  # noqa: B006  (a config default, never mutated)
        stem_strides: int = 2,  # stride of the `small` stem: 2 halves the resolution, 1 keeps it
        # `basic`: two 3x3 convolutions; `bottleneck`: 1x1, 3x3, 1x1, 4 x the width out.
        block: str = "basic",
        # `small`: a 3x3 convolution, no max-pool; `imagenet`: a 7x7 stride-2 convolution and a 3x3
        # stride-2 max-pool, as ImageNet ResNets (and their checkpoints) have.
        stem: str = "small",
        # `same`: SAME, a strided convolution padded (0, 1); `symmetric`: kernel_size // 2 on every
        # side, as torch pads (what weights trained in torch need).
        padding: str = "same",
        # Per-channel mean that the model subtracts from its inputs itself, `(x - mean) / std`, as
        # pretrained weights expect (give it pixels in [0, 1]); null (with pixel_std): inputs as
        # they come.
        pixel_mean: list[float] | None = None,
        # Per-channel std it divides by: one value per input channel, as pixel_mean.
        pixel_std: list[float] | None = None,
        *,
        rngs: nnx.Rngs,
    ):
        hparams.positive(
            "resnet",
            input_shape=input_shape,
            num_classes=num_classes,
            width=width,
            stage_sizes=stage_sizes,
            stem_strides=stem_strides,
        )
        hparams.choice(
            "resnet", block=(block, BLOCKS), stem=(stem, STEMS), padding=(padding, PADDINGS)
        )
        self.pixel_mean, self.pixel_std = hparams.pixel_statistics(
            pixel_mean, pixel_std, input_shape
        )
        self.max_pool = stem == "imagenet"
        if self.max_pool:
            self.stem = _conv(input_shape[-1], width, 7, 2, padding, rngs)
        else:
            self.stem = _conv(input_shape[-1], width, 3, stem_strides, padding, rngs)
        self.stem_norm = batch_norm(width, rngs=rngs)
        kind = BasicBlock if block == "basic" else Bottleneck
        expansion = BOTTLENECK_EXPANSION if block == "bottleneck" else 1
        blocks, cin = [], width
        for stage, size in enumerate(stage_sizes):
            stage_width = width * 2**stage
            # The first block of a stage changes the width (and, after the first stage, strides);
            # the others are alike.
            blocks.append(kind(cin, stage_width, 2 if stage else 1, padding, rngs=rngs))
            cin = stage_width * expansion
            alike = functools.partial(kind, cin, stage_width, 1, padding, rngs=rngs)
            blocks += repeated(lambda _, alike=alike: alike(), size - 1)
        self.blocks = nnx.List(blocks)
        self.head = dense(cin, num_classes, (split_by_fsdp("conv_out"), None), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.pixel_mean is not None:
            x = (x - jnp.asarray(self.pixel_mean, x.dtype)) / jnp.asarray(self.pixel_std, x.dtype)
        h = nnx.relu(self.stem_norm(self.stem(x, out_sharding=_feature_map())))
        if self.max_pool:  # pads with -inf, as torch's MaxPool2d(3, 2, padding=1) does
            h = nnx.max_pool(h, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(axis=(1, 2)), out_sharding=logical_spec("batch", None))

"""A mixture of experts' picture at each eval: how many of the eval split's tokens each layer's
router sends to each expert (`visuals/expert_load`), the decoder's `on_eval` beside its text
samples. A router that sends most tokens to a few experts wastes the others; the training
loss's `router_aux_loss` pushes against it, and this picture shows where it has not."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
from PIL import Image, ImageDraw, ImageFont
from zoo.models.eval_samples import sample_on_eval
from zoo.models.experts import load_balancing, mixture_layers, routed_call

from zoo.plugin import MASK, POSITIONS, SEGMENT_IDS, EvalReport, logical_spec, real_inputs

FONT_SIZE = 12
MARGIN = 8
WIDTH = 768
"""The cells' width together, in pixels, where experts are many (each at least 2 wide)."""


def decoder_on_eval(model: nnx.Module, report: EvalReport) -> None:
    """The decoder's eval hook: its text samples (`sample_on_eval`) and, for a mixture of
    experts, its expert load (`expert_load_on_eval`)."""
    sample_on_eval(model, report)
    if mixture_layers(model):
        expert_load_on_eval(model, report)


def expert_load_on_eval(model: nnx.Module, report: EvalReport) -> None:
    """Tokens per expert of every mixture layer over the eval split: an image (a row per layer,
    a cell per expert, the darker the more tokens, scaled to the busiest cell) and the counts as
    a text table."""
    total = None
    for batch in report.batches():
        counts = expert_load(model, {k: v for k, v in batch.items() if k in _READ})
        # One batch ahead at most, as `zoo.engine.loop.evaluate_batches` keeps its eval steps.
        total = counts if total is None else jax.block_until_ready(total) + counts
    if total is None:
        return
    counts, names = np.asarray(total), list(mixture_layers(model))
    report.image("visuals/expert_load", load_image(counts, names))
    header = "| layer | " + " | ".join(str(e) for e in range(counts.shape[1])) + " |"
    rule = "|---" * (counts.shape[1] + 1) + "|"
    lines = [
        f"| {n} | " + " | ".join(f"{c:.0f}" for c in row) + " |" for n, row in zip(names, counts)
    ]
    report.text("visuals/expert_load", "\n".join([header, rule, *lines]))


_READ = ("tokens", "length", MASK, SEGMENT_IDS, POSITIONS)


@nnx.jit
def expert_load(model: nnx.Module, batch: Mapping[str, jax.Array]) -> jax.Array:
    """The tokens per expert [layers, E] of the mixture layers (`mixture_layers`) in one eval
    batch: its real tokens (not padding, nor a padding row), a pair's two sequences each, a
    packed row's sequences each apart."""
    tokens = batch["tokens"]
    rows = logical_spec("batch", None)
    flat = jnp.reshape(tokens, (-1, tokens.shape[-1]), out_sharding=rows)[:, :-1]
    per_row = tokens.shape[1] if tokens.ndim == 3 else 1  # a pair's sequences
    length = jnp.reshape(batch["length"], (-1,), out_sharding=logical_spec("batch"))
    packed = {name: batch[name] for name in (SEGMENT_IDS, POSITIONS) if name in batch}
    real = real_inputs(length, flat.shape[1], packed.get(SEGMENT_IDS))
    if MASK in batch:
        kept = jnp.broadcast_to(batch[MASK][:, None] > 0, (batch[MASK].shape[0], per_row))
        real = real & jnp.reshape(kept, (-1,), out_sharding=logical_spec("batch"))[:, None]
    _, routing = routed_call(model, lambda m: m(flat, **packed))
    real = jnp.reshape(real, (-1,), out_sharding=logical_spec("batch"))
    _, load = load_balancing(list(routing.layers.values()), real)
    return jax.sharding.reshard(load, P())


def load_image(counts: np.ndarray, names: list[str]) -> np.ndarray:
    """[layers, E] token counts as an RGB image: the layers' names down the left, "experts"
    over the cells, each cell shaded blue by its count over the busiest cell's."""
    layers, experts = counts.shape
    cell = max(2, min(24, WIDTH // experts))
    height = max(cell, FONT_SIZE + 4)
    font = ImageFont.load_default(size=FONT_SIZE)
    left = MARGIN + int(max(font.getlength(n) for n in names)) + MARGIN
    top = MARGIN + FONT_SIZE + MARGIN
    image = Image.new(
        "RGB", (left + experts * cell + MARGIN, top + layers * height + MARGIN), "white"
    )
    draw = ImageDraw.Draw(image)
    draw.text((left, MARGIN), f"experts 0-{experts - 1}", fill="black", font=font)
    shade = counts / max(float(counts.max()), 1.0)
    for i, name in enumerate(names):
        y = top + i * height
        draw.text((MARGIN, y + (height - FONT_SIZE) // 2), name, fill="black", font=font)
        for e in range(experts):
            level = int(255 * (1.0 - shade[i, e]))
            x = left + e * cell
            draw.rectangle([x, y, x + cell - 1, y + height - 2], fill=(level, level, 255))
    return np.asarray(image, np.float32) / 255.0

"""The loss of every image classifier (softmax cross-entropy on integer labels, with accuracy),
and their eval report: a confusion matrix over the whole eval split and a grid of misclassified
examples, in TensorBoard after each eval."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P
from PIL import Image, ImageDraw, ImageFont

from zoo.plugin import MASK, EvalReport, image_grid, loss_contract

MISCLASSIFIED = 32
"""How many misclassified eval examples the report shows."""
CELL = 36
"""Pixels per cell of the confusion matrix image."""
FONT_SIZE = 12
MARGIN = 8
"""Pixels of white around the confusion matrix image's labels."""
DIAGONAL = (8, 48, 107)  # dark blue: every example of the class predicted right
ERROR = (165, 15, 21)  # dark red: the most frequent confusion


def _loss(logits: jax.Array, labels: jax.Array):
    loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return loss, {"accuracy": (logits.argmax(-1) == labels).astype(jnp.float32)}


@loss_contract(columns=("image", "label"), metrics=("accuracy",))
def classification_loss(model: nnx.Module, batch: Mapping[str, jax.Array], rngs: nnx.Rngs):
    """For models that hold their randomness (module-bound Dropout streams): `model(image)`."""
    return _loss(model(batch["image"]), batch["label"])


@loss_contract(columns=("image", "label"), metrics=("accuracy",))
def classification_loss_with_rngs(
    model: nnx.Module, batch: Mapping[str, jax.Array], rngs: nnx.Rngs
):
    """For models that take their randomness at call time: `model(image, rngs=rngs)`, with the
    trainer's fresh per-step keys."""
    return _loss(model(batch["image"], rngs=rngs), batch["label"])


@nnx.jit
def _outcomes(model: nnx.Module, batch: Mapping[str, jax.Array]):
    """One eval batch's confusion counts (true class x predicted class, padding excluded), and
    its predictions and labels, replicated so that any process can read them."""
    logits = model(batch["image"])
    classes = logits.shape[-1]
    predicted = logits.argmax(-1)
    real = batch[MASK].astype(jnp.float32)[:, None]
    truth = jax.nn.one_hot(batch["label"], classes) * real
    confusion = jnp.einsum("bi,bj->ij", truth, jax.nn.one_hot(predicted, classes), out_sharding=P())
    wrong = (predicted != batch["label"]) & (batch[MASK] > 0)
    return confusion, *(jax.sharding.reshard(x, P()) for x in (predicted, batch["label"], wrong))


def report_classifier(model: nnx.Module, report: EvalReport) -> None:
    """The classifiers' `on_eval` hook: one pass of the model over every eval batch.

    Writes `visuals/confusion_matrix` (an image: rows are true classes, by name where the
    data set names them, columns predicted ones, the counts in the cells; and the counts as a
    text table) and `visuals/misclassified` (the first misclassified eval images, with a
    text line of true -> predicted class per row of the grid)."""
    confusion = None
    images, captions = [], []
    for batch in report.batches():
        counts, predicted, labels, wrong = _outcomes(model, batch)
        confusion = counts if confusion is None else confusion + counts
        if len(images) < MISCLASSIFIED:
            rows = np.flatnonzero(np.asarray(wrong))[: MISCLASSIFIED - len(images)]
            if len(rows):
                pixels = np.asarray(jax.sharding.reshard(batch["image"], P()))[rows]
                images.extend(pixels)
                true, guess = np.asarray(labels)[rows], np.asarray(predicted)[rows]
                names = class_labels(report.class_names, int(counts.shape[0]), numbered=False)
                captions.extend(f"{names[t]}->{names[g]}" for t, g in zip(true, guess, strict=True))
    counts = np.asarray(confusion)
    report.image("visuals/confusion_matrix", confusion_image(counts, report.class_names))
    report.text("visuals/confusion_matrix", confusion_table(counts, report.class_names))
    if images:
        stack = np.stack(images).astype(np.float32)
        scaled = (stack - stack.min()) / max(float(stack.max() - stack.min()), 1e-12)
        report.image("visuals/misclassified", image_grid(scaled, columns=8))
        lines = [", ".join(captions[i : i + 8]) for i in range(0, len(captions), 8)]
        report.text("visuals/misclassified", "\n".join(f"    {line}" for line in lines))


def class_labels(names: Sequence[str] | None, classes: int, numbered: bool = True) -> list[str]:
    """`0 T-shirt/top`, ... (or `T-shirt/top` unnumbered) where the data set names its
    classes, one name per class; else the numbers."""
    if not names or len(names) != classes:
        return [str(i) for i in range(classes)]
    return [f"{i} {name}" if numbered else name for i, name in enumerate(names)]


def confusion_image(counts: np.ndarray, names: Sequence[str] | None = None) -> np.ndarray:
    """The matrix as a labelled RGB image: true classes down (with their names), predicted
    classes across, each cell's count written in it. The diagonal is shaded blue by the share
    of its class's examples; the errors red, the most frequent confusion darkest (by square
    root, so that a few errors stay visible at high accuracy). The axis titles ("true" turned
    along the rows, "predicted" over the columns) sit `MARGIN` pixels in from the edges, so a
    card that scales the image down keeps them whole."""
    classes = counts.shape[0]
    rows = class_labels(names, classes)
    font = ImageFont.load_default(size=FONT_SIZE)
    line = FONT_SIZE + MARGIN // 2  # the height of a line of text, with room under it
    left = MARGIN + line + int(max(font.getlength(text) for text in rows)) + MARGIN
    top = MARGIN + 2 * line
    size = classes * CELL
    image = Image.new("RGB", (left + size + MARGIN, top + size + MARGIN), "white")
    draw = ImageDraw.Draw(image)
    draw.text((left + size // 2, MARGIN), "predicted", fill="black", font=font, anchor="mt")
    title = Image.new("RGB", (int(font.getlength("true")) + 2, line), "white")
    ImageDraw.Draw(title).text((0, 0), "true", fill="black", font=font)
    title = title.rotate(90, expand=True)
    image.paste(title, (MARGIN, top + (size - title.height) // 2))
    _draw_cells(draw, font, counts, rows, left, top)
    return np.asarray(image, np.float32) / 255.0


def _draw_cells(draw, font, counts: np.ndarray, rows: Sequence[str], left: int, top: int) -> None:
    """The column numbers, the row labels and the shaded cells with their counts."""
    classes = counts.shape[0]
    shares = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    errors = counts * (1 - np.eye(classes))
    worst = max(float(errors.max()), 1.0)
    for j in range(classes):
        x = left + j * CELL + CELL // 2
        draw.text((x, top - 2), str(j), fill="black", font=font, anchor="md")
    for i, row in enumerate(rows):
        y = top + i * CELL
        draw.text((left - 6, y + CELL // 2), row, fill="black", font=font, anchor="rm")
        for j in range(classes):
            x = left + j * CELL
            strength = shares[i, j] if i == j else np.sqrt(errors[i, j] / worst)
            color = DIAGONAL if i == j else ERROR
            fill = tuple(int(255 - strength * (255 - c)) for c in color)
            draw.rectangle((x, y, x + CELL, y + CELL), fill=fill, outline=(200, 200, 200))
            if counts[i, j]:
                ink = "white" if strength > 0.5 else "black"
                middle = (x + CELL // 2, y + CELL // 2)
                draw.text(middle, str(int(counts[i, j])), fill=ink, font=font, anchor="mm")


def confusion_table(counts: np.ndarray, names: Sequence[str] | None = None) -> str:
    """The counts as a markdown table, true classes down (with their names), predicted
    classes across."""
    rows = class_labels(names, counts.shape[0])
    classes = range(counts.shape[0])
    lines = [
        "| true \\ predicted | " + " | ".join(map(str, classes)) + " |",
        "|---" * (counts.shape[0] + 1) + "|",
    ]
    for i in classes:
        lines.append(f"| **{rows[i]}** | " + " | ".join(str(int(c)) for c in counts[i]) + " |")
    return "\n".join(lines)

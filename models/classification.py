"""The loss of every image classifier (softmax cross-entropy on integer labels, with accuracy),
and their eval report: a confusion matrix over the whole eval split and a grid of misclassified
examples, in TensorBoard after each eval."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from train.pipeline import MASK
from train.registry import reads_columns
from train.report import EvalReport, image_grid

MISCLASSIFIED = 32
"""How many misclassified eval examples the report shows."""
CELL = 12
"""Pixels per cell of the confusion matrix image."""


def _loss(logits: jax.Array, labels: jax.Array):
    loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return loss, {"accuracy": (logits.argmax(-1) == labels).astype(jnp.float32)}


@reads_columns("image", "label")
def classification_loss(model: nnx.Module, batch: Mapping[str, jax.Array], rngs: nnx.Rngs):
    """For models that hold their randomness (module-bound Dropout streams): `model(image)`."""
    return _loss(model(batch["image"]), batch["label"])


@reads_columns("image", "label")
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

    Writes `classifier/confusion_matrix` (an image: rows are true classes, columns predicted
    ones, each row shaded by the share of its examples; and the counts as a text table) and
    `classifier/misclassified` (the first misclassified eval images, with a text line of true ->
    predicted class per row of the grid)."""
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
                captions.extend(f"{t}->{g}" for t, g in zip(true, guess, strict=True))
    counts = np.asarray(confusion)
    report.image("classifier/confusion_matrix", confusion_image(counts))
    report.text("classifier/confusion_matrix", confusion_table(counts))
    if images:
        stack = np.stack(images).astype(np.float32)
        scaled = (stack - stack.min()) / max(float(stack.max() - stack.min()), 1e-12)
        report.image("classifier/misclassified", image_grid(scaled, columns=8))
        lines = [" ".join(captions[i : i + 8]) for i in range(0, len(captions), 8)]
        report.text("classifier/misclassified", "\n".join(f"    {line}" for line in lines))


def confusion_image(counts: np.ndarray) -> np.ndarray:
    """An RGB image of the matrix, `CELL` pixels per cell: white for none of a true class's
    examples, dark blue for all of them."""
    share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    dark = np.array([0.03, 0.19, 0.42], np.float32)
    rgb = 1.0 - share[..., None] * (1.0 - dark)
    return np.repeat(np.repeat(rgb, CELL, axis=0), CELL, axis=1)


def confusion_table(counts: np.ndarray) -> str:
    """The counts as a markdown table, true classes down, predicted classes across."""
    classes = range(counts.shape[0])
    lines = [
        "| true \\ predicted | " + " | ".join(map(str, classes)) + " |",
        "|---" * (counts.shape[0] + 1) + "|",
    ]
    for i in classes:
        lines.append(f"| **{i}** | " + " | ".join(str(int(c)) for c in counts[i]) + " |")
    return "\n".join(lines)

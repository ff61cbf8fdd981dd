"""The loss of every image classifier: softmax cross-entropy on integer labels, with accuracy."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import optax
from flax import nnx


def _loss(logits: jax.Array, labels: jax.Array):
    loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)
    return loss, {"accuracy": (logits.argmax(-1) == labels).astype(jnp.float32)}


def classification_loss(model: nnx.Module, batch: Mapping[str, jax.Array], rngs: nnx.Rngs):
    """For models that hold their randomness (module-bound Dropout streams): `model(image)`."""
    return _loss(model(batch["image"]), batch["label"])


def classification_loss_with_rngs(
    model: nnx.Module, batch: Mapping[str, jax.Array], rngs: nnx.Rngs
):
    """For models that take their randomness at call time: `model(image, rngs=rngs)`, with the
    trainer's fresh per-step keys."""
    return _loss(model(batch["image"], rngs=rngs), batch["label"])

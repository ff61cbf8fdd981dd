"""`zoo.predict`: a trained model's outputs for a batch of inputs, on its mesh, the inputs
checked first (`zoo.inputs.Reads`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zoo.data.image_processors import PREPROCESSOR, load_image_processor
from zoo.data.siglip_tokenizer import MODEL as SPIECE
from zoo.data.siglip_tokenizer import SiglipTokenizer
from zoo.engine import sharding
from zoo.engine.errors import ZooError
from zoo.inputs import Reads
from zoo.trained import Trained

TEMPLATE = "This is a photo of {}."
"""The sentence each label is put in for zero-shot classification (transformers' zero-shot
image classification pipeline's default `hypothesis_template`)."""


@nnx.jit
def _forward(model: nnx.Module, inputs: jax.Array) -> Any:
    return model(inputs)


def predict(
    trained: Trained,
    inputs: Any = None,
    *,
    labels: Sequence[str] | None = None,
    template: str = TEMPLATE,
    texts: Sequence[str] | None = None,
) -> Any:
    """The model's outputs (logits; a tuple of arrays for a model that returns several, such as
    `vae`) for a batch of inputs as the model takes them (e.g. normalised float images,
    N x H x W x C: a data set's `transform` makes them), on the model's mesh.

    Inputs the model cannot take are refused by name before it runs (see `Reads`): strings
    and other non-numbers, one example without its batch axis, a shape or width it cannot
    take, raw integer pixels, token ids that are not integers of its vocabulary.
    A language model's logits have one column per token of its vocabulary (`vocab_size`).

    `labels` (siglip): zero-shot classification of `inputs`, images (paths, bytes, PIL images,
    uint8 arrays; or float pixels as the checkpoint's image processor makes them): each image's
    probability of each label, images x labels, the sigmoid of SigLIP's score of the image and
    `template.format(label)` (labels are scored independently: they need not sum to 1).

    `texts` (siglip, without `inputs` or `labels`): the texts' embeddings, texts x
    projection_dim, L2-normalised as transformers' `text_embeds` (and as `predict(model,
    pixels)` gives the images'), the texts tokenised as they are (no `template`) by the
    checkpoint's tokenizer."""
    if texts is not None:
        return text_embeddings(trained, inputs, texts, labels)
    if inputs is None:
        raise ZooError(
            "predict got no inputs: it takes a batch of inputs as the model takes them (or, "
            "for a siglip model, texts=[...] alone for their embeddings)."
        )
    if labels is not None:
        return zero_shot(trained, inputs, labels, template)
    reads = Reads.of(trained.config)
    inputs = reads.check(inputs, "predict got inputs")
    if not reads.decides(inputs):
        graphdef, state = nnx.split(trained.model)
        with trained.activate():
            reads.check_traced(graphdef, state, inputs, "predict got inputs")
    shards = sharding.batch_divisor(trained.mesh, trained.rules)
    padding = -len(inputs) % shards
    padded = np.concatenate([inputs, np.repeat(inputs[-1:], padding, axis=0)])
    with trained.activate():
        batch = sharding.shard_batch({"inputs": padded}, trained.mesh, trained.rules)
        outputs = _forward(trained.model, batch["inputs"])
    outputs = jax.tree.map(lambda x: np.asarray(x)[: len(inputs)], jax.device_get(outputs))
    return within_vocabulary(trained.model, outputs)


def within_vocabulary(model: nnx.Module, outputs: Any) -> Any:
    """A language model's logits over its vocabulary alone: a model whose embedding has rows
    past its `vocab_size` (padded so that it shards) masks their logits, and they are dropped."""
    vocab = getattr(model, "vocab_size", None)
    if not isinstance(vocab, int) or not isinstance(outputs, np.ndarray | jax.Array):
        return outputs
    return outputs[..., :vocab] if outputs.ndim and outputs.shape[-1] > vocab else outputs


def text_embeddings(
    trained: Trained, inputs: Any, texts: Sequence[str], labels: Sequence[str] | None
) -> np.ndarray:
    """SigLIP's L2-normalised text embeddings, texts x projection_dim, the texts tokenised as
    the checkpoint's `spiece.model` says, on the model's mesh."""
    model = trained.model
    name = trained.config.model.name
    if not hasattr(model, "embed_texts"):
        raise ZooError(
            f"predict(texts=...) gives a siglip model's text embeddings; this is model "
            f"'{name}', which has no text tower."
        )
    if inputs is not None or labels is not None:
        given = "inputs" if inputs is not None else "labels"
        raise ZooError(
            f"predict(texts=...) takes the texts alone (it gives their embeddings); it got "
            f"{given} too: pass images with labels=[...] for zero-shot probabilities, or "
            f"images alone for their embeddings."
        )
    if isinstance(texts, str) or not len(texts) or not all(isinstance(t, str) for t in texts):
        raise ZooError(
            f"predict(texts=...) takes a non-empty list of strings; it got texts={texts!r}."
        )
    ids, mask = _tokenized(trained, list(texts))
    shards = sharding.batch_divisor(trained.mesh, trained.rules)
    with trained.activate():
        embeds = _texts(model, _padded(ids, shards), _padded(mask, shards))
    return np.asarray(jax.device_get(embeds))[: len(texts)]


@nnx.jit
def _texts(model: nnx.Module, ids: jax.Array, mask: jax.Array) -> jax.Array:
    texts = model.embed_texts(ids, mask)
    return texts / jnp.linalg.norm(texts, axis=-1, keepdims=True)


def _tokenized(trained: Trained, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """`texts`' ids and attention mask by the checkpoint's tokenizer, checked to fit the
    model's text positions."""
    directory = _processor_files(trained)
    tokenizer = SiglipTokenizer(directory)
    if tokenizer.length > trained.model.context_length:
        raise ZooError(
            f"{directory}'s tokenizer pads texts to {tokenizer.length} tokens; the model reads "
            f"{trained.model.context_length} at most."
        )
    return tokenizer(texts)


def zero_shot(trained: Trained, images: Any, labels: Sequence[str], template: str) -> np.ndarray:
    """SigLIP's probabilities, images x labels: the images prepared and the labels' sentences
    tokenised as the checkpoint's processor files say (`preprocessor_config.json`,
    `spiece.model`), scored on the model's mesh."""
    model = trained.model
    if not hasattr(model, "embed_texts") or isinstance(labels, str) or not labels:
        raise ZooError(
            f"predict(labels=...) is zero-shot classification by a siglip model with a list of "
            f"label texts; this is model '{trained.config.model.name}' with labels={labels!r}."
        )
    pixels = _pixels(images, _processor_files(trained), model)
    ids, mask = _tokenized(trained, [template.format(label) for label in labels])
    shards = sharding.batch_divisor(trained.mesh, trained.rules)
    with trained.activate():
        batch = sharding.shard_batch(
            {"pixels": _padded(pixels, shards)}, trained.mesh, trained.rules
        )
        logits = _scores(model, batch["pixels"], _padded(ids, shards), _padded(mask, shards))
    logits = np.asarray(jax.device_get(logits))[: len(pixels), : len(labels)]
    return 1 / (1 + np.exp(-logits.astype(np.float64)))


@nnx.jit
def _scores(model: nnx.Module, pixels: jax.Array, ids: jax.Array, mask: jax.Array) -> jax.Array:
    return model.logits(pixels, ids, mask)


def _padded(rows: np.ndarray, shards: int) -> np.ndarray:
    """`rows` with copies of the last one, so that their count splits `shards` ways."""
    return np.concatenate([rows, np.repeat(rows[-1:], -len(rows) % shards, axis=0)])


def _processor_files(trained: Trained) -> str:
    """The directory of the checkpoint's tokenizer: the pretrained directory it was loaded
    from, or the one a run was fine-tuned from."""
    for directory in (trained.workdir, trained.config.get("finetune", {}).get("init_from")):
        if directory and os.path.isfile(os.path.join(str(directory), SPIECE)):
            return str(directory)
    raise ZooError(
        f"{trained.workdir} has no {SPIECE} (nor has the checkpoint it started from): "
        "zero-shot labels need SigLIP's tokenizer."
    )


def _pixels(images: Any, directory: str, model: nnx.Module) -> np.ndarray:
    """Float arrays as they are (pixels the image processor made); other images through the
    checkpoint's image processor (SigLIP's defaults at the model's size without one)."""
    if isinstance(images, np.ndarray) and np.issubdtype(images.dtype, np.floating):
        return images.astype(np.float32)
    if os.path.isfile(os.path.join(directory, PREPROCESSOR)):
        processor = load_image_processor(directory)
    else:
        height, width = model.image_size
        settings = {"height": height, "width": width}
        processor = load_image_processor(
            {"image_processor_type": "SiglipImageProcessor", "size": settings}
        )
    return processor(images).pixel_values

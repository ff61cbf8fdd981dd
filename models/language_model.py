"""What zoo's language models (`gpt`, `decoder`) share: the byte vocabulary and the padding of a
vocabulary's rows, the first step of a forward pass (the tokens' embeddings) and the last (the
final norm and the logits), the loss, and the training defaults.

The embedding's rows are padded to a multiple of `VOCAB_MULTIPLE`, so the vocabulary shards over
`tensor` whatever its size; the padded rows' logits are masked out.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from zoo.models.experts import routed_call
from zoo.models.transformer import dropout_key, tokens_spec

from zoo.plugin import (
    LOSS_MASK,
    POSITIONS,
    SEGMENT_IDS,
    WEIGHT,
    ZooError,
    logical_spec,
    loss_contract,
    outputs_first_product,
    real_inputs,
)

VOCAB = 256
"""The byte-level vocabulary, the default."""
VOCAB_MULTIPLE = 128
"""The embedding's rows are padded to a multiple of this, so any tensor-parallel size up to it
that divides it shards the vocabulary."""
_MASKED = -1e30  # the logit of a padded row: softmax gives it exactly zero probability

LANGUAGE_MODEL_TRAINER = {"steps": 1400, "batch_size": 16, "log_every": 50, "eval_every": 350}
"""The language models' schedule: 2.9 MB of text, two thirds of the default corpus's training
bytes, 16 x 128 bytes a step (gpt: under 4 minutes on a 2-core CPU)."""
LANGUAGE_MODEL_OPTIMIZER = {
    "name": "adamw",
    "learning_rate": 3e-3,
    "schedule": "cosine",
    "warmup_steps": 100,
    "weight_decay": 0.01,
    "grad_clip_norm": 1.0,
}


def padded_vocab(vocab_size: int) -> int:
    """The embedding's number of rows for a vocabulary of `vocab_size` tokens."""
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def embed_tokens(tokens: jax.Array, table: jax.Array) -> jax.Array:
    """The rows of `table` that `tokens` name: a gather, except for a table of at most `VOCAB`
    rows (the byte-level default), which keeps the one-hot matmul it was trained with: the two
    compute the same rows, but their gradients sum repeated tokens in a different order, and
    byte-level runs stay bit for bit what they were."""
    if table.shape[0] <= VOCAB:
        one_hot = jax.nn.one_hot(tokens, table.shape[0], dtype=table.dtype)
        return jnp.einsum("btv,vd->btd", one_hot, table, out_sharding=tokens_spec())
    rows = jax.sharding.reshard(table, P())  # every device looks up any token's row
    return rows.at[tokens].get(out_sharding=tokens_spec())


def embedded(tokens: jax.Array, table: jax.Array, context_length: int, model: str) -> jax.Array:
    """A forward pass's first step: the rows of the embedding `table` that `tokens` name,
    refused by name where the sequences are longer than the model's `context_length` (its
    positions and its cache end there)."""
    length = tokens.shape[1]
    if length > context_length:
        raise ZooError(
            f"{model} got sequences of {length} tokens, more than model.context_length="
            f"{context_length}: use data.window (and data.buckets) of at most "
            f"{context_length}, or a larger model.context_length."
        )
    return embed_tokens(tokens, table)


def output_logits(
    x: jax.Array,
    *,
    norm: Callable[[jax.Array], jax.Array],
    table: jax.Array,
    unembed: Any,
    vocab_size: int,
    last_only: bool = False,
    softcap: float = 0.0,
) -> jax.Array:
    """A forward pass's last step: the final `norm` of the layers' output `x` (of each row's
    last position only with `last_only`, all a prefill needs), then the logits through the
    embedding `table` (tied) or the output layer `unembed` (None: tied), soft-capped to
    (-softcap, softcap) by softcap * tanh(logits / softcap) where `softcap` is not 0, the padded
    rows' masked."""
    if last_only:  # the output layer for one position, not the whole prompt
        x = x[:, -1:]
    x = norm(x)
    if unembed is None:
        logits = tied_logits(x, table)
    else:
        logits = unembed(x, out_sharding=logical_spec("batch", None, "vocab"))
    if softcap:
        logits = softcap * jnp.tanh(logits / softcap)
    return mask_padding(logits, vocab_size)


def mask_padding(logits: jax.Array, vocab_size: int) -> jax.Array:
    """`logits` over a padded vocabulary with the padded rows' masked out."""
    if logits.shape[-1] == vocab_size:
        return logits
    real = jnp.arange(logits.shape[-1]) < vocab_size
    return jnp.where(real, logits, jnp.asarray(_MASKED, logits.dtype))


def tied_logits(x: jax.Array, table: jax.Array) -> jax.Array:
    """The logits of `x` (batch x length x features) through the embedding `table` (vocabulary
    x features). For one position a row (a decode step) it is a `TransposedLinear`'s product
    (`outputs_first_product`): the table first, as XLA:CPU multiplies a large matrix by a few
    rows several times faster (151,936 x 1,024 by 8 rows: 150 ms against 330 ms on one core),
    or zoo's bfloat16 kernel; longer rows keep the order whose output needs no transposing."""
    vocab = logical_spec("batch", None, "vocab")
    if x.shape[1] != 1:
        return jnp.einsum("btd,vd->btv", x, table, out_sharding=vocab)
    return outputs_first_product(x, table, out_sharding=vocab)


def layers_dropout_key(
    rngs: nnx.Rngs | None, layers: Any, stacked: bool, rate: float, model: str
) -> jax.Array:
    """The key a language model's `layers` draw their Dropout masks from in a call
    (`dropout_key`); each layer holds its Dropout as `dropout`, and `stacked` layers
    (`scan_layers`) are one module."""
    first = layers.dropout if stacked else layers[0].dropout
    return dropout_key(rngs, rate, first.deterministic, model)


@loss_contract(columns=("tokens", "length"), metrics=("bits_per_byte",))
def language_model_loss(model: Any, batch: Mapping[str, jax.Array], rngs: nnx.Rngs):
    """Per sequence: the mean cross-entropy (nats) of its real next-token predictions, and the
    same in bits per byte (per token, with a tokenizer); weighted by its number of real targets,
    so that the trainer's means are exact means over tokens, padding excluded. With a
    `LOSS_MASK` column (a chat's replies) only the targets it marks count, and `loss_tokens`
    says how many the batch has (a mean over the log window's steps). Packed rows (`SEGMENT_IDS`
    and `POSITIONS` columns) go to the model with them, and `packing_efficiency` says which
    share of the batch's targets are real (not padding). A mixture of experts adds its router's
    load-balancing loss times `router_aux_loss_coef` (over the real input tokens), and reports
    it (`router_aux_loss`) and each layer's `expert_load` (`zoo.models.experts`)."""
    tokens = batch["tokens"].astype(jnp.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    packed = {name: batch[name] for name in (SEGMENT_IDS, POSITIONS) if name in batch}
    logits, routing = routed_call(model, lambda m: m(inputs, rngs=rngs, **packed))
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    per_token = -jnp.sum(jax.nn.one_hot(targets, log_probs.shape[-1]) * log_probs, axis=-1)
    real_targets = jnp.arange(targets.shape[1])[None, :] < batch["length"][:, None]
    real = real_targets.astype(jnp.float32)
    if LOSS_MASK in batch:
        real = real * batch[LOSS_MASK].astype(jnp.float32)
    count = jnp.sum(real, axis=-1)
    loss = jnp.sum(per_token * real, axis=-1) / jnp.maximum(count, 1.0)
    unit = "bits_per_byte" if model.vocab_size == VOCAB else "bits_per_token"
    metrics = {unit: loss / math.log(2), WEIGHT: count}
    if LOSS_MASK in batch:  # the same for every sequence: its weighted mean is the batch's sum
        metrics["loss_tokens"] = jnp.zeros_like(count) + jnp.sum(count)
    if packed:
        metrics["packing_efficiency"] = jnp.zeros_like(count) + jnp.mean(real_targets)
    if routing.layers:  # a mixture of experts: its router's loss, its experts' load
        real = real_inputs(batch["length"], inputs.shape[1], packed.get(SEGMENT_IDS))
        router_loss, routed = routing.loss_and_metrics(real)
        loss = loss + router_loss
        metrics.update({name: jnp.zeros_like(count) + value for name, value in routed.items()})
    return loss, metrics

"""A decoder-only transformer language model: over bytes by default (vocabulary 256, no
tokenizer), or over a tokenizer's vocabulary of any size (`vocab_size`; GPT-2's is 50,257).

Token embedding (a gather of rows) + learned positions -> pre-norm blocks (causal multi-head
attention, GELU MLP) -> final norm -> logits over the vocabulary, through the embedding itself
(tied, the default) or a separate output layer. The embedding's rows are padded to a multiple
of `VOCAB_MULTIPLE`, so the vocabulary shards over `tensor` whatever its size; the padded rows'
logits are masked out. `attention_bias`, `norm_epsilon`, `exact_gelu`, `scale_attention` and
`scale_attention_by_layer` are the block options that pretrained checkpoints differ in (see
`zoo.models.gpt_params` for GPT-2's).

The blocks can be stacked into one module whose params carry a leading layer axis and run with
`nnx.scan` (`scan_layers`: one compiled block instead of `depth` copies, so compile time does
not grow with depth), and each block can be rematerialised with `nnx.remat` (`remat`: the
backward pass recomputes a block's activations instead of storing them). Either way every layer
is initialised from the same per-layer key, so both modes hold the same weights and compute the
same loss and gradients.

Randomness comes at call time, like `vit`: Dropout draws from the trainer's per-step keys.
Heads and MLP hidden units are on the logical `heads`/`mlp` axes (tensor parallel), the
embedding on (`vocab`, `embed`), so FSDP shards it along its width.

`decode(tokens, cache, slots)` runs the same blocks on new tokens against a key/value cache
(`zoo.models.kv_cache`; generation: `zoo.models.generation`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from zoo.models import hparams
from zoo.models.generate import sample_on_eval
from zoo.models.kv_cache import DecodesWithCache, KVCache
from zoo.models.layers import dense, layer_norm
from zoo.models.transformer import Block, BlockOptions, dropout_key, tokens_spec

from zoo.plugin import (
    LOSS_MASK,
    POSITIONS,
    SEGMENT_IDS,
    WEIGHT,
    ZooError,
    construction_rngs,
    logical_spec,
    loss_contract,
    outputs_first_product,
    partitioned,
    register_model,
    repeated,
)

VOCAB = 256
"""The byte-level vocabulary, the default."""
VOCAB_MULTIPLE = 128
"""The embedding's rows are padded to a multiple of this, so any tensor-parallel size up to it
that divides it shards the vocabulary."""
_MASKED = -1e30  # the logit of a padded row: softmax gives it exactly zero probability
Cache = tuple[KVCache, ...] | KVCache
"""A language model's key/value cache: one (keys, values) pair per layer, or one pair of
stacked arrays for stacked layers (`scan_layers`)."""


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


def padded_vocab(vocab_size: int) -> int:
    """The embedding's number of rows for a vocabulary of `vocab_size` tokens."""
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def _apply_block(block: Block, x, key, cache, slots, query_scale=None):
    return block(x, key, cache, slots, query_scale)


_remat_block = nnx.remat(_apply_block)


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


@loss_contract(columns=("tokens", "length"), metrics=("bits_per_byte",))
def language_model_loss(model: GPT, batch: Mapping[str, jax.Array], rngs: nnx.Rngs):
    """Per sequence: the mean cross-entropy (nats) of its real next-token predictions, and the
    same in bits per byte (per token, with a tokenizer); weighted by its number of real targets,
    so that the trainer's means are exact means over tokens, padding excluded. With a
    `LOSS_MASK` column (a chat's replies) only the targets it marks count, and `loss_tokens`
    says how many the batch has (a mean over the log window's steps). Packed rows (`SEGMENT_IDS`
    and `POSITIONS` columns) go to the model with them, and `packing_efficiency` says which
    share of the batch's targets are real (not padding)."""
    tokens = batch["tokens"].astype(jnp.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    packed = {name: batch[name] for name in (SEGMENT_IDS, POSITIONS) if name in batch}
    logits = model(inputs, rngs=rngs, **packed)
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
    return loss, metrics


@register_model(
    "gpt",
    loss=language_model_loss,
    default_data="text",
    on_eval=sample_on_eval,
    trainer=LANGUAGE_MODEL_TRAINER,
    optimizer=LANGUAGE_MODEL_OPTIMIZER,
    tiny=(
        "model.context_length=32",
        "model.dim=32",
        "model.depth=2",
        "model.num_heads=2",
        "model.mlp_ratio=2",
        "data.window=32",
        "data.eval_bytes=4096",
    ),
)
class GPT(nnx.Module, DecodesWithCache):
    def __init__(
        self,
        context_length: int = 128,  # positions the model has: sequences may not be longer
        dim: int = 128,  # width of the token embeddings and every block
        depth: int = 4,  # transformer blocks
        num_heads: int = 4,  # attention heads: they must divide `dim`
        mlp_ratio: int = 4,  # each block's MLP hidden width, as a multiple of `dim`
        dropout_rate: float = 0.0,  # Dropout on each block's attention and MLP outputs
        # Logits through the input embedding; false: a separate output layer.
        tie_embeddings: bool = True,
        # Store the blocks stacked (a leading layer axis) and run them with `nnx.scan`: compile time
        # no longer grows with depth; the same weights, another checkpoint layout.
        scan_layers: bool = False,
        # Recompute each block's activations in the backward pass (`nnx.remat`) instead of keeping
        # them: less memory, more compute.
        remat: bool = False,
        # Tokens in the vocabulary: 256 bytes without a tokenizer; with data.tokenizer, at least its
        # ids (GPT-2's: 50257).
        vocab_size: int = VOCAB,
        # Biases on attention's query, key, value and output projections.
        attention_bias: bool = False,
        norm_epsilon: float = 1e-6,  # epsilon of every LayerNorm
        exact_gelu: bool = False,  # the MLP's exact (erf) GELU instead of its tanh approximation
        # Divide the attention logits by the square root of the head size; false: leave them as
        # they are (GPT-2's scale_attn_weights=false).
        scale_attention: bool = True,
        # Also divide block i's attention logits by i + 1 (GPT-2's
        # scale_attn_by_inverse_layer_idx).
        scale_attention_by_layer: bool = False,
        *,
        rngs: nnx.Rngs,
    ):
        hparams.positive(
            "gpt",
            context_length=context_length,
            dim=dim,
            depth=depth,
            num_heads=num_heads,
            mlp_ratio=mlp_ratio,
            vocab_size=vocab_size,
        )
        if not norm_epsilon > 0:
            raise ZooError(f"model.norm_epsilon={norm_epsilon} must be positive (gpt).")
        hparams.rates("gpt", dropout_rate=dropout_rate)
        if dim % num_heads:
            raise ZooError(f"gpt: dim={dim} must be a multiple of num_heads={num_heads}.")
        normal = nnx.initializers.normal(0.02)
        self.embedding = nnx.Param(
            partitioned(normal, ("vocab", "embed"))(rngs.params(), (padded_vocab(vocab_size), dim))
        )
        self.positions = nnx.Param(
            partitioned(normal, (None, "embed"))(rngs.params(), (context_length, dim))
        )

        scale = None if scale_attention else 1.0  # None: 1/sqrt(head size)
        options = BlockOptions(mlp_ratio, attention_bias, norm_epsilon, exact_gelu, scale)

        def block(key: jax.Array) -> Block:
            return Block(
                dim,
                num_heads,
                mlp_ratio,
                dropout_rate,
                causal=True,
                options=options,
                rngs=construction_rngs(params=key),
            )

        layer_keys = jax.random.split(rngs.params(), depth)
        if scan_layers:  # one Block whose params have a leading (unsharded) layer axis
            self.blocks = nnx.vmap(block, transform_metadata={nnx.PARTITION_NAME: None})(layer_keys)
        else:
            self.blocks = nnx.List(repeated(lambda i: block(layer_keys[i]), depth))
        self.norm = layer_norm(dim, rngs=rngs, epsilon=norm_epsilon)
        self.unembed = (
            None
            if tie_embeddings
            else dense(dim, padded_vocab(vocab_size), ("embed", "vocab"), use_bias=False, rngs=rngs)
        )
        self.context_length, self.depth, self.num_heads = context_length, depth, num_heads
        self.vocab_size = vocab_size
        self.head_dim = dim // num_heads
        self.scan_layers, self.remat, self.dropout_rate = scan_layers, remat, dropout_rate
        # Block i's queries times 1 / (i + 1): its attention logits divided by i + 1.
        self.query_scales = (
            tuple(1 / (i + 1) for i in range(depth)) if scale_attention_by_layer else None
        )

    def __call__(self, tokens: jax.Array, *, rngs: nnx.Rngs | None = None) -> jax.Array:
        """Next-token logits (batch x length x padded vocabulary; the padded rows' are masked)
        for every position of `tokens`."""
        first = self.blocks.dropout if self.scan_layers else self.blocks[0].dropout
        key = dropout_key(rngs, self.dropout_rate, first.deterministic, "gpt")
        logits, _ = self._forward(tokens, key, None, None)
        return logits

    def empty_cache(self, batch_size: int, slots: int) -> Cache:
        """A key/value cache for `decode`: `slots` positions of every layer (one array of all
        layers with `scan_layers`), in the dtype the model computes in (its params': bfloat16
        for a copy made by `trainer.precision=bf16`)."""
        shape = (batch_size, slots, self.num_heads, self.head_dim)
        spec = logical_spec("batch", None, "heads", None)
        dtype = self.embedding[...].dtype
        if self.scan_layers:
            stacked = (self.depth, *shape)
            return tuple(jnp.zeros(stacked, dtype, out_sharding=P(None, *spec)) for _ in range(2))
        return tuple(
            tuple(jnp.zeros(shape, dtype, out_sharding=spec) for _ in range(2))
            for _ in range(self.depth)
        )

    def _forward(self, tokens, key, cache, slots, last_only=False):
        length = tokens.shape[1]
        if length > self.context_length:
            raise ZooError(
                f"gpt got sequences of {length} tokens, more than model.context_length="
                f"{self.context_length}: use data.window (and data.buckets) of at most "
                f"{self.context_length}, or a larger model.context_length."
            )
        table = self.embedding[...]
        x = embed_tokens(tokens, table)
        # Stored split by FSDP; whole on every device where they meet the batch-sharded tokens.
        held = jax.sharding.reshard(self.positions[...], P())
        if slots is None:
            x = x + held[:length]
        else:  # each row's own positions
            x = x + held.at[slots.positions(length)].get(out_sharding=tokens_spec())
        x, cache = self._run_blocks(x, jax.random.split(key, self.depth), cache, slots)
        if last_only:  # the output layer for one position, not the whole prompt
            x = x[:, -1:]
        x = self.norm(x)
        if self.unembed is None:
            logits = tied_logits(x, table)
        else:
            logits = self.unembed(x, out_sharding=logical_spec("batch", None, "vocab"))
        return mask_padding(logits, self.vocab_size), cache

    def _run_blocks(self, x, keys, cache, slots):
        apply = _remat_block if self.remat else _apply_block
        if self.scan_layers:

            @nnx.scan(in_axes=(0, nnx.Carry, 0, 0, None, 0), out_axes=(nnx.Carry, 0))
            def scan(block, x, key, layer_cache, slots, query_scale):
                return apply(block, x, key, layer_cache, slots, query_scale)

            scales = None if self.query_scales is None else jnp.asarray(self.query_scales)
            return scan(self.blocks, x, keys, cache, slots, scales)
        layer_caches = []
        for i, block in enumerate(self.blocks):
            layer_cache = None if cache is None else cache[i]
            scale = None if self.query_scales is None else self.query_scales[i]
            x, layer_cache = apply(block, x, keys[i], layer_cache, slots, scale)
            layer_caches.append(layer_cache)
        return x, None if cache is None else tuple(layer_caches)

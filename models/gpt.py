"""A decoder-only transformer language model: over bytes by default (vocabulary 256, no
tokenizer), or over a tokenizer's vocabulary of any size (`vocab_size`; GPT-2's is 50,257).

Token embedding (a gather of rows) + learned positions -> pre-norm blocks (causal multi-head
attention, GELU MLP) -> final norm -> logits over the vocabulary, through the embedding itself
(tied, the default) or a separate output layer. The embedding's rows are padded to a multiple
of `VOCAB_MULTIPLE`, so the vocabulary shards over `tensor` whatever its size; the padded rows'
logits are masked out (`zoo.models.language_model`, which `decoder` shares). `attention_bias`,
`norm_epsilon`, `exact_gelu`, `scale_attention` and `scale_attention_by_layer` are the block
options that pretrained checkpoints differ in (see `zoo.models.gpt_params` for GPT-2's).

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
(`zoo.models.kv_cache`; generation: `zoo.models.sampling_loop`).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from zoo.models import hparams
from zoo.models.eval_samples import sample_on_eval
from zoo.models.kv_cache import Cache, DecodesWithCache, empty_cache
from zoo.models.language_model import (
    LANGUAGE_MODEL_OPTIMIZER,
    LANGUAGE_MODEL_TRAINER,
    VOCAB,
    embedded,
    language_model_loss,
    layers_dropout_key,
    output_logits,
    padded_vocab,
)
from zoo.models.layers import dense, layer_norm, layer_stack, learned
from zoo.models.sampling_loop import sample_completions
from zoo.models.transformer import Block, BlockOptions, tokens_spec

from zoo.plugin import ZooError, logical_spec, register_model


def _apply_block(block: Block, x, key, cache, slots, query_scale=None):
    return block(x, key, cache, slots, query_scale)


_remat_block = nnx.remat(_apply_block)


@register_model(
    "gpt",
    loss=language_model_loss,
    default_data="text",
    on_eval=sample_on_eval,
    sample=sample_completions,
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
        """A GPT of these options (each a `model.*` key), checked first, its params drawn from
        `rngs` in a fixed order: the token embedding, the positions, the blocks (each from its
        own key), the final norm, the output layer."""
        _check_options(
            context_length, dim, depth, num_heads, mlp_ratio, vocab_size, norm_epsilon, dropout_rate
        )
        self.embedding = learned((padded_vocab(vocab_size), dim), ("vocab", "embed"), rngs=rngs)
        self.positions = learned((context_length, dim), (None, "embed"), rngs=rngs)
        scale = None if scale_attention else 1.0  # None: 1/sqrt(head size)
        options = BlockOptions(mlp_ratio, attention_bias, norm_epsilon, exact_gelu, scale)
        block = partial(
            Block, dim, num_heads, mlp_ratio, dropout_rate, causal=True, options=options
        )
        self.blocks = layer_stack(block, depth, scan_layers, rngs.params())
        self.norm = layer_norm(dim, rngs=rngs, epsilon=norm_epsilon)
        self.unembed = None if tie_embeddings else _unembed(dim, vocab_size, rngs)
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
        key = layers_dropout_key(rngs, self.blocks, self.scan_layers, self.dropout_rate, "gpt")
        logits, _ = self._forward(tokens, key, None, None)
        return logits

    def empty_cache(self, batch_size: int, slots: int) -> Cache:
        """A key/value cache for `decode`: `slots` positions of every layer (one array of all
        layers with `scan_layers`), in the dtype the model computes in (its params': bfloat16
        for a copy made by `trainer.precision=bf16`)."""
        return empty_cache(
            batch_size,
            slots,
            (self.num_heads, self.head_dim),
            dtype=self.embedding[...].dtype,
            spec=logical_spec("batch", None, "heads", None),
            windows=(0,) * self.depth,
            stacked=self.scan_layers,
        )

    def _forward(self, tokens, key, cache, slots, last_only=False):
        table = self.embedding[...]
        x = embedded(tokens, table, self.context_length, "gpt")
        # Stored split by FSDP; whole on every device where they meet the batch-sharded tokens.
        held = jax.sharding.reshard(self.positions[...], P())
        length = tokens.shape[1]
        if slots is None:
            x = x + held[:length]
        else:  # each row's own positions
            x = x + held.at[slots.positions(length)].get(out_sharding=tokens_spec())
        x, cache = self._run_blocks(x, jax.random.split(key, self.depth), cache, slots)
        logits = output_logits(
            x,
            norm=self.norm,
            table=table,
            unembed=self.unembed,
            vocab_size=self.vocab_size,
            last_only=last_only,
        )
        return logits, cache

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


def _check_options(
    context_length: int,
    dim: int,
    depth: int,
    num_heads: int,
    mlp_ratio: int,
    vocab_size: int,
    norm_epsilon: float,
    dropout_rate: float,
) -> None:
    """Every size at least 1, `norm_epsilon` positive, the dropout rate in [0, 1), and heads
    that split `dim`."""
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


def _unembed(dim: int, vocab_size: int, rngs: nnx.Rngs) -> nnx.Linear:
    """The output layer of untied embeddings: `dim` features to the padded vocabulary."""
    return dense(dim, padded_vocab(vocab_size), ("embed", "vocab"), use_bias=False, rngs=rngs)

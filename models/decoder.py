"""A modern decoder-only language model: the architecture of Llama 3, Qwen 2.5 and 3, Mistral and
Gemma 3, trained from scratch (bytes by default, or a tokenizer's ids) or loaded from their
checkpoints (`zoo.models.decoder_params`).

Token embedding (times sqrt(dim) with `embed_scale`, Gemma) -> layers of RMSNorm, grouped-query
attention with rotary positions and a gated MLP (`zoo.models.decoder_parts`) -> final RMSNorm ->
logits through the embedding (tied) or a separate output layer, soft-capped with
`final_softcap`. The options are those the checkpoints differ in; each says which family uses
it. Each layer attends to every earlier position (`full_attention`) or to the last
`sliding_window` only (`sliding_attention`), by `layer_types`; sliding layers may rotate with
their own base (`local_rope_theta`, Gemma 3's local layers).

As in `gpt`: the vocabulary is padded to a multiple of 128 rows, the padded logits masked;
`scan_layers` stacks the layers and runs them with `nnx.scan` (layers of both types too: each
scanned step runs the branch of its layer's type), `remat` recomputes a layer's activations in
the backward pass; every layer is initialised from its own key either way, so both layouts hold
the same weights. `decode(tokens, cache, slots)` runs new tokens against a key/value cache of
`num_kv_heads` heads, a sliding layer's bounded by its window (`zoo.models.kv_cache`;
generation: `zoo.models.generation`). A packed row of several sequences (`data.packing`,
`zoo.data.packing`) comes with each token's sequence and position in it: attention stays within
a sequence, in every kind of layer, and rotary positions restart at each.

`param_dtype=bf16` holds every param in bfloat16 (a checkpoint as it is stored: half the
memory) and computes in it; norms' statistics and attention's softmax stay float32, as does the
loss.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P
from zoo.models import hparams
from zoo.models.decoder_parts import (
    ACTIVATIONS,
    FULL,
    LAYER_TYPES,
    SLIDING,
    DecoderLayer,
    LayerOptions,
    kv_heads_spec,
)
from zoo.models.generate import sample_on_eval
from zoo.models.gpt import (
    LANGUAGE_MODEL_OPTIMIZER,
    LANGUAGE_MODEL_TRAINER,
    VOCAB,
    Cache,
    embed_tokens,
    language_model_loss,
    mask_padding,
    padded_vocab,
    tied_logits,
)
from zoo.models.kv_cache import DecodesWithCache, cache_slots
from zoo.models.rope import ROPE_TYPES, Rope, Rotation, rotation
from zoo.models.transformer import dropout_key

from zoo.plugin import (
    TransposedLinear,
    ZooError,
    construction_rngs,
    logical_spec,
    partitioned,
    register_model,
    repeated,
)

PARAM_DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


@register_model(
    "decoder",
    loss=language_model_loss,
    default_data="text",
    on_eval=sample_on_eval,
    trainer=LANGUAGE_MODEL_TRAINER,  # gpt's schedule and optimizer
    optimizer=LANGUAGE_MODEL_OPTIMIZER,
    tiny=(
        "model.context_length=32",
        "model.dim=32",
        "model.depth=2",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        "model.mlp_dim=64",
        "model.sliding_window=8",
        "model.layer_types=[sliding_attention,full_attention]",
        "model.qk_norm=true",
        "data.window=32",
        "data.eval_bytes=4096",
    ),
)
class Decoder(nnx.Module, DecodesWithCache):
    PACKED_ROWS = True
    """It takes packed rows (`segment_ids`, `positions`: see `__call__`)."""

    def __init__(
        self,
        # Tokens in the vocabulary: 256 bytes without a tokenizer; with data.tokenizer, at least its
        # ids.
        vocab_size: int = VOCAB,
        # Positions the model has (a checkpoint's max_position_embeddings): sequences, and the
        # key/value cache of generation, are at most this long.
        context_length: int = 128,
        dim: int = 128,  # width of the token embeddings and every layer (hidden_size)
        depth: int = 4,  # layers (num_hidden_layers)
        num_heads: int = 4,  # query heads (num_attention_heads)
        # Key/value heads, each shared by num_heads / num_kv_heads query heads (grouped-query
        # attention; 1: multi-query); 0: as many as num_heads.
        num_kv_heads: int = 0,
        # Features of each head; 0: dim / num_heads (Qwen 3 and Gemma 3 set it independently).
        head_dim: int = 0,
        # Hidden width of the gated MLP (intermediate_size); 0: 8/3 of dim rounded up to a multiple
        # of 64, which holds about the weights of a 4 x dim two-layer MLP.
        mlp_dim: int = 0,
        # The gated MLP's activation: `silu` (SwiGLU: Llama, Mistral, Qwen) or `gelu_tanh` (GeGLU
        # with tanh-approximated GELU: Gemma).
        activation: str = "silu",
        norm_epsilon: float = 1e-6,  # epsilon of every RMSNorm (rms_norm_eps)
        # RMSNorm scales by 1 + w instead of w (Gemma), w held as the checkpoint stores it.
        norm_unit_offset: bool = False,
        # A norm after attention and after the MLP too, before each is added back (Gemma).
        post_norms: bool = False,
        qk_norm: bool = False,  # RMSNorm of each query and key head before the rotation (Qwen 3)
        qkv_bias: bool = False,  # biases on the query, key and value projections (Qwen 2)
        out_bias: bool = False,  # a bias on attention's output projection
        mlp_bias: bool = False,  # biases on the MLP's gate, up and down projections
        rope_theta: float = 10000.0,  # base of the rotary frequencies of full-attention layers
        # Scaling of those frequencies: `default` (none), `linear` (divided by rope_factor) or
        # `llama3` (Llama 3.1's, with the three parameters below).
        rope_type: str = "default",
        rope_factor: float = 1.0,  # the `linear` and `llama3` scaling factor
        rope_low_freq_factor: float = 1.0,  # `llama3`: low_freq_factor
        rope_high_freq_factor: float = 4.0,  # `llama3`: high_freq_factor
        rope_original_context: int = 8192,  # `llama3`: original_max_position_embeddings
        # Base of sliding-window layers' rotary frequencies, unscaled (Gemma 3: 10000); 0: those of
        # the full-attention layers, scaling included.
        local_rope_theta: float = 0.0,
        # Positions a sliding-window layer sees, itself included (a query at i sees keys j with
        # i - sliding_window < j <= i); 0: no sliding-window layers.
        sliding_window: int = 0,
        # Each layer's attention, `full_attention` or `sliding_attention`, one per layer; null:
        # every layer sliding when sliding_window > 0 (Mistral), else every layer full.
        layer_types: list[str] | None = None,
        # Attention logits are scaled by query_scale ** -0.5; 0: head_dim (Gemma 3 sets its
        # query_pre_attn_scalar).
        query_scale: float = 0.0,
        # Attention logits soft-capped to (-cap, cap) by cap * tanh(logits / cap); 0: not capped.
        attention_softcap: float = 0.0,
        final_softcap: float = 0.0,  # the output logits soft-capped the same way; 0: not capped
        # Embeddings multiplied by sqrt(dim), rounded to the params' dtype (Gemma).
        embed_scale: bool = False,
        # Logits through the input embedding; false: a separate output layer.
        tie_embeddings: bool = True,
        dropout_rate: float = 0.0,  # Dropout on each layer's attention and MLP outputs
        # Store the layers stacked (a leading layer axis) and run them with `nnx.scan`: compile time
        # no longer grows with depth; the same weights, another checkpoint layout.
        scan_layers: bool = False,
        # Recompute each layer's activations in the backward pass (`nnx.remat`) instead of keeping
        # them: less memory, more compute.
        remat: bool = False,
        # The dtype every param is held and computed in: `fp32`, or `bf16` (half the memory; a
        # bfloat16 checkpoint as it is stored).
        param_dtype: str = "fp32",
        *,
        rngs: nnx.Rngs,
    ):
        types = _checked(locals())
        num_kv_heads, head_dim = num_kv_heads or num_heads, head_dim or dim // num_heads
        dtype = jnp.dtype(PARAM_DTYPES[param_dtype])
        options = LayerOptions(
            dim=dim,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            mlp_dim=mlp_dim or _default_mlp_dim(dim),
            activation=activation,
            norm_epsilon=norm_epsilon,
            norm_unit_offset=norm_unit_offset,
            post_norms=post_norms,
            qk_norm=qk_norm,
            qkv_bias=qkv_bias,
            out_bias=out_bias,
            mlp_bias=mlp_bias,
            query_scale=query_scale,
            attention_softcap=attention_softcap,
            dropout_rate=dropout_rate,
            dtype=dtype,
        )
        init = partitioned(nnx.initializers.normal(0.02), ("vocab", "embed"))
        self.embedding = nnx.Param(init(rngs.params(), (padded_vocab(vocab_size), dim), dtype))

        def layer(key: jax.Array) -> DecoderLayer:
            return DecoderLayer(options, rngs=construction_rngs(params=key))

        layer_keys = jax.random.split(rngs.params(), depth)
        if scan_layers:  # one layer whose params have a leading (unsharded) layer axis
            self.layers = nnx.vmap(layer, transform_metadata={nnx.PARTITION_NAME: None})(layer_keys)
        else:
            self.layers = nnx.List(repeated(lambda i: layer(layer_keys[i]), depth))
        self.norm = options.norm(dim, rngs)
        self.unembed = (
            None
            if tie_embeddings
            else TransposedLinear(
                dim,
                padded_vocab(vocab_size),
                kernel_axes=("vocab", "embed"),
                param_dtype=dtype,
                rngs=rngs,
            )
        )
        global_rope = Rope(
            rope_theta,
            rope_type,
            rope_factor,
            rope_low_freq_factor,
            rope_high_freq_factor,
            rope_original_context,
        )
        self.rope, self.local_rope = (
            global_rope,
            Rope(local_rope_theta) if local_rope_theta else global_rope,
        )
        self.sliding_window, self.layer_types = sliding_window, tuple(types)
        self.vocab_size, self.context_length, self.depth = vocab_size, context_length, depth
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.embed_scale = float(np.float32(math.sqrt(dim))) if embed_scale else 0.0
        self.final_softcap = final_softcap
        self.scan_layers, self.remat, self.dropout_rate = scan_layers, remat, dropout_rate

    def __call__(
        self,
        tokens: jax.Array,
        *,
        rngs: nnx.Rngs | None = None,
        segment_ids: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> jax.Array:
        """Next-token logits (batch x length x padded vocabulary; the padded rows' are masked)
        for every position of `tokens`. A packed row (`zoo.data.packing`) gives each token's
        sequence, `segment_ids` (batch x length), and its position within it, `positions`:
        a token then attends to its own sequence's alone, at rotary positions from 0 in each."""
        first = self.layers.dropout if self.scan_layers else self.layers[0].dropout
        key = dropout_key(rngs, self.dropout_rate, first.deterministic, "decoder")
        logits, _ = self._forward(tokens, key, None, None, segment_ids, positions)
        return logits

    def empty_cache(self, batch_size: int, slots: int) -> Cache:
        """A key/value cache for `decode` of `num_kv_heads` heads, in the dtype the model
        computes in (its params'): `slots` positions for every full-attention layer, at most
        its window for a sliding one (a ring buffer, `zoo.models.kv_cache`); with
        `scan_layers`, one array of all layers, `slots` long."""
        spec = kv_heads_spec(self.num_kv_heads, "batch", None, "kv_heads", None)
        dtype = self.embedding[...].dtype

        def zeros(length: int, *layers: int) -> jax.Array:
            shape = (*layers, batch_size, length, self.num_kv_heads, self.head_dim)
            return jnp.zeros(shape, dtype, out_sharding=P(*(None,) * len(layers), *spec))

        if self.scan_layers:
            return zeros(slots, self.depth), zeros(slots, self.depth)
        lengths = (cache_slots(slots, self._window(kind)) for kind in self.layer_types)
        return tuple((zeros(length), zeros(length)) for length in lengths)

    def _forward(self, tokens, key, cache, slots, segments=None, positions=None, last_only=False):
        length = tokens.shape[1]
        if length > self.context_length:
            raise ZooError(
                f"decoder got sequences of {length} tokens, more than model.context_length="
                f"{self.context_length}: use data.window (and data.buckets) of at most "
                f"{self.context_length}, or a larger model.context_length."
            )
        table = self.embedding[...]
        x = embed_tokens(tokens, table)
        if self.embed_scale:
            x = x * jnp.asarray(self.embed_scale, table.dtype)
        if positions is None:  # a row's own, known now: the rotation's tables are constants
            positions = np.arange(length) if slots is None else slots.positions(length)
        angles = {FULL: rotation(self.rope, self.head_dim, positions, x.dtype)}
        angles[SLIDING] = (
            angles[FULL]
            if self.local_rope == self.rope
            else rotation(self.local_rope, self.head_dim, positions, x.dtype)
        )
        keys = jax.random.split(key, self.depth)
        x, cache = self._run_layers(x, keys, angles, cache, slots, segments)
        if last_only:  # the output layer for one position, not the whole prompt
            x = x[:, -1:]
        x = self.norm(x)
        if self.unembed is None:
            logits = tied_logits(x, table)
        else:
            logits = self.unembed(x, out_sharding=logical_spec("batch", None, "vocab"))
        if self.final_softcap:
            logits = self.final_softcap * jnp.tanh(logits / self.final_softcap)
        return mask_padding(logits, self.vocab_size), cache

    def _window(self, kind: str) -> int:
        return self.sliding_window if kind == SLIDING else 0

    def _step(self, kind: str):
        """One layer of type `kind` as a function of the layer and its inputs (rematerialised
        with `remat`); the window and which rotation it takes are fixed by `kind`."""
        window = self._window(kind)

        def apply(layer, x, key, cache, slots, angles, segments):
            return layer(x, key, angles[kind], window, cache, slots, segments)

        return nnx.remat(apply) if self.remat else apply

    def _run_layers(self, x, keys, angles: dict[str, Rotation], cache, slots, segments):
        if self.scan_layers:
            return self._scan_layers(x, keys, angles, cache, slots, segments)
        layer_caches = []
        for i, (layer, kind) in enumerate(zip(self.layers, self.layer_types, strict=True)):
            layer_cache = None if cache is None else cache[i]
            step = self._step(kind)
            x, layer_cache = step(layer, x, keys[i], layer_cache, slots, angles, segments)
            layer_caches.append(layer_cache)
        return x, None if cache is None else tuple(layer_caches)

    def _scan_layers(self, x, keys, angles, cache, slots, segments):
        steps = {kind: self._step(kind) for kind in set(self.layer_types)}
        sliding = jnp.asarray([kind == SLIDING for kind in self.layer_types])

        @nnx.scan(in_axes=(0, nnx.Carry, 0, 0, 0, None, None, None), out_axes=(nnx.Carry, 0))
        def scan(layer, x, key, layer_cache, is_sliding, slots, angles, segments):
            args = (layer, x, key, layer_cache, slots, angles, segments)
            if len(steps) == 1:
                (step,) = steps.values()
                return step(*args)
            # Layers of both types: each scanned step runs the branch of its layer's type.
            return nnx.cond(is_sliding, steps[SLIDING], steps[FULL], *args)

        return scan(self.layers, x, keys, cache, sliding, slots, angles, segments)


def _default_mlp_dim(dim: int) -> int:
    """8/3 of `dim` rounded up to a multiple of 64: a gated MLP's three matrices then hold about
    the weights of a two-matrix MLP 4 x `dim` wide."""
    return 64 * -(-8 * dim // (3 * 64))


def _checked(params: dict) -> list[str]:
    """Refuse, naming the key, any hyper-parameter the model cannot be built with; returns
    each layer's attention type."""
    p = {k: v for k, v in params.items() if k not in ("self", "rngs")}
    hparams.positive(
        "decoder",
        **{k: p[k] for k in ("vocab_size", "context_length", "dim", "depth", "num_heads")},
        rope_original_context=p["rope_original_context"],
    )
    for key in ("num_kv_heads", "head_dim", "mlp_dim", "sliding_window"):
        if not isinstance(p[key], int) or p[key] < 0:
            raise ZooError(f"model.{key}={p[key]} must be a whole number >= 0 (0: the default).")
    for key in ("norm_epsilon", "rope_theta", "rope_factor"):
        if not p[key] > 0:
            raise ZooError(f"model.{key}={p[key]} must be positive (decoder).")
    for key in ("local_rope_theta", "query_scale", "attention_softcap", "final_softcap"):
        if not (math.isfinite(p[key]) and p[key] >= 0):
            raise ZooError(f"model.{key}={p[key]} must be >= 0 (0: off, or the default).")
    hparams.rates("decoder", dropout_rate=p["dropout_rate"])
    hparams.choice(
        "decoder",
        activation=(p["activation"], tuple(ACTIVATIONS)),
        rope_type=(p["rope_type"], ROPE_TYPES),
        param_dtype=(p["param_dtype"], tuple(PARAM_DTYPES)),
    )
    num_heads, num_kv_heads = p["num_heads"], p["num_kv_heads"] or p["num_heads"]
    if num_heads % num_kv_heads:
        raise ZooError(
            f"model.num_kv_heads={num_kv_heads} must divide model.num_heads={num_heads} "
            "(each key/value head serves an equal group of query heads)."
        )
    head_dim = p["head_dim"] or p["dim"] // num_heads
    if not p["head_dim"] and p["dim"] % num_heads:
        raise ZooError(
            f"model.dim={p['dim']} must be a multiple of model.num_heads={num_heads} when "
            "model.head_dim=0 (the heads split dim); or give model.head_dim."
        )
    if head_dim % 2:
        raise ZooError(
            f"The heads' width {head_dim} (model.head_dim, or dim / num_heads) must be even: "
            "rotary positions turn pairs of features."
        )
    if p["rope_type"] == "llama3" and not p["rope_high_freq_factor"] > p["rope_low_freq_factor"]:
        raise ZooError(
            f"model.rope_high_freq_factor={p['rope_high_freq_factor']} must exceed "
            f"model.rope_low_freq_factor={p['rope_low_freq_factor']} for rope_type=llama3."
        )
    return _layer_types(p["layer_types"], p["depth"], p["sliding_window"])


def _layer_types(given: list[str] | None, depth: int, window: int) -> list[str]:
    if given is None:
        return [SLIDING if window else FULL] * depth
    given = list(given)
    if len(given) != depth:
        raise ZooError(
            f"model.layer_types={given} lists {len(given)} layers, but model.depth={depth}: "
            "give one type per layer (or null)."
        )
    for i, kind in enumerate(given):
        if kind not in LAYER_TYPES:
            raise ZooError(
                f"model.layer_types[{i}]={kind!r} is not a decoder layer type: choose one of "
                f"{', '.join(LAYER_TYPES)}."
            )
    if SLIDING in given and not window:
        raise ZooError(
            f"model.layer_types={given} has {SLIDING} layers but model.sliding_window=0: "
            "give the window's length in positions."
        )
    return given

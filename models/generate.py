"""Sampling text from a language model with a key/value cache (`gpt`):
`zoo.generate(model, prompt, max_new_tokens, ...)`.

The model is used through what it offers, not its class: `decode(tokens, cache, start)`,
`empty_cache(batch_size)`, `context_length` and `vocab_size`.

One jitted function does it all: a prefill that runs the prompt through the model once, filling
a fixed-size key/value cache, then a `lax.fori_loop` that samples one token (a byte, byte-level) at a time, each step feeding that
token alone through the model against the cache. The cache and the output buffer are
`context_length` long whatever the prompt and the number of new tokens, and the prompt is
padded to a power-of-two bucket, so generating compiles once per bucket (at most
log2(context_length) + 1 times per model), never once per prompt length or per token.

Randomness is explicit: every sampled token's key is `fold_in(key, i)` of the key given (or of
`jax.random.key(seed)`), so the same seed gives the same text.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from zoo.plugin import ZooError, unsplit_batch


def generate(
    model: Any, prompt: str | bytes, *args: Any, tokenizer: Any = None, **kwargs: Any
) -> str:
    """The text that `model` writes after `prompt` (`max_new_tokens=100, temperature=1.0,
    top_k=0, seed=0`, as `generate_tokens` takes them). Byte-level: `generate_bytes` decoded
    as UTF-8, each invalid sequence (a byte model may write any bytes) replaced by U+FFFD. With
    `tokenizer` (a `tokenizers.Tokenizer`, the one the model was trained with): the prompt is
    encoded into its ids and the new ids are decoded by it."""
    if tokenizer is None:
        return generate_bytes(model, prompt, *args, **kwargs).decode("utf-8", errors="replace")
    text = prompt.decode("utf-8", errors="replace") if isinstance(prompt, bytes) else prompt
    ids = tokenizer.encode(text or "\n", add_special_tokens=False).ids
    if max(ids, default=0) >= model.vocab_size:
        raise ZooError(
            f"The tokenizer gives id {max(ids)} for the prompt, beyond the model's vocabulary "
            f"of {model.vocab_size}: use the tokenizer the model was trained with."
        )
    new = generate_tokens(model, np.asarray(ids, np.int32), *args, **kwargs)
    return tokenizer.decode(new.tolist(), skip_special_tokens=False)


def generate_bytes(model: Any, prompt: str | bytes, *args: Any, **kwargs: Any) -> bytes:
    """The bytes that a byte-level `model` writes after `prompt` (see `generate_tokens`)."""
    data = prompt.encode() if isinstance(prompt, str) else bytes(prompt)
    tokens = np.frombuffer(data or b"\n", np.uint8)
    return generate_tokens(model, tokens, *args, **kwargs).astype(np.uint8).tobytes()


def generate_tokens(
    model: Any,
    prompt: np.ndarray,
    max_new_tokens: int = 100,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int | jax.Array = 0,
) -> np.ndarray:
    """The `max_new_tokens` token ids (int32) that `model` writes after the ids `prompt`.
    `temperature` 0 picks the likeliest token every time; `top_k` > 0 samples among the k
    likeliest only. `seed`: an int or a JAX key.

    The prompt keeps its last `context_length - max_new_tokens` tokens. Call it where the
    model's mesh is active (`with result.activate():`); the batch of one is not split over the
    mesh."""
    if not all(hasattr(model, name) for name in ("decode", "empty_cache", "vocab_size")):
        raise ZooError(
            f"zoo.generate needs a language model with a key/value cache (gpt), got "
            f"{type(model).__name__}."
        )
    context, vocab = model.context_length, model.vocab_size
    if not 1 <= max_new_tokens < context:
        raise ZooError(
            f"max_new_tokens={max_new_tokens} must lie between 1 and context_length - 1 = "
            f"{context - 1}: prompt and new tokens share the model's {context} positions."
        )
    if temperature < 0 or not 0 <= top_k <= vocab:
        raise ZooError(
            f"temperature={temperature} must be >= 0 (0: greedy) and top_k={top_k} between 0 "
            f"(no limit) and {vocab}."
        )
    kept = prompt[max(0, len(prompt) - (context - max_new_tokens)) :]
    bucket = min(context, 1 << (len(kept) - 1).bit_length())
    buffer = np.zeros(context, np.int32)
    buffer[: len(kept)] = kept
    key = jax.random.key(seed) if isinstance(seed, int) else seed
    graphdef, state = nnx.split(model)
    with unsplit_batch():
        out = _generate(
            graphdef, state, buffer, len(kept), max_new_tokens, temperature, top_k, key, bucket
        )
    return np.asarray(out)[len(kept) : len(kept) + max_new_tokens]


@functools.partial(jax.jit, static_argnames=("graphdef", "bucket"))
def _generate(graphdef, state, buffer, prompt_length, max_new, temperature, top_k, key, bucket):
    def model(state):
        m = nnx.merge(graphdef, state)
        m.eval()
        return m

    buffer = jax.sharding.reshard(buffer, P())  # onto the mesh, like every other array here
    prefill = model(state)
    logits, cache = prefill.decode(buffer[None, :bucket], prefill.empty_cache(1), 0)
    last = jax.lax.dynamic_index_in_dim(logits[0], prompt_length - 1, keepdims=False)

    # The weights ride in the loop's carry: a module merged inside the loop from its own
    # values is of the loop's trace level, as NNX's transforms (remat, scan) require.
    def step(i, carry):
        buffer, cache, last, state = carry
        byte = _sample(last, temperature, top_k, jax.random.fold_in(key, i))
        position = prompt_length + i
        buffer = jax.lax.dynamic_update_index_in_dim(buffer, byte, position, 0)
        logits, cache = model(state).decode(byte[None, None], cache, position)
        return buffer, cache, logits[0, 0], state

    buffer, *_ = jax.lax.fori_loop(0, max_new, step, (buffer, cache, last, state))
    return buffer


def _sample(logits: jax.Array, temperature, top_k, key: jax.Array) -> jax.Array:
    logits = jax.sharding.reshard(logits.astype(jnp.float32), P())  # all 256 in one place
    kth_largest = jnp.sort(logits)[logits.shape[-1] - jnp.maximum(top_k, 1)]
    allowed = (top_k == 0) | (logits >= kth_largest)
    scaled = jnp.where(allowed, logits, -jnp.inf) / jnp.maximum(temperature, 1e-6)
    sampled = jax.random.categorical(key, scaled)
    byte = jnp.where(temperature > 0, sampled, jnp.argmax(logits)).astype(jnp.int32)
    return jax.sharding.reshard(byte, P())


def sample_on_eval(model: Any, report) -> None:
    """The `gpt` eval hook: continue the start of the first held-out example, written to
    TensorBoard (text `sample`) and the console; decoded by the data set's tokenizer, if the
    tokens are its ids."""
    tokens, length = report.examples["tokens"][0], int(report.examples["length"][0])
    prompt, tokenizer = tokens[: min(length, model.context_length // 2)], report.tokenizer
    new_tokens = model.context_length // 2
    if tokenizer is None:
        prompt = prompt.astype(np.uint8).tobytes()
        new = generate(model, prompt, new_tokens, temperature=0.8, seed=report.key)
        shown = prompt.decode("utf-8", errors="replace")
    else:
        ids = generate_tokens(model, prompt, new_tokens, temperature=0.8, seed=report.key)
        shown, new = tokenizer.decode(prompt.tolist()), tokenizer.decode(ids.tolist())
    report.text("sample", _as_markdown(shown, new))
    report.log(f"sample @ step {report.step}: {shown!r} -> {new!r}")


def _as_markdown(prompt: str, continuation: str) -> str:
    """The prompt and the model's continuation as TensorBoard shows text: two code blocks
    (indented, so any text is shown as it is, newlines and all)."""

    def block(text: str) -> str:
        return "\n".join("    " + line for line in text.splitlines() or [""])

    return f"**prompt**\n\n{block(prompt)}\n\n**continuation**\n\n{block(continuation)}"

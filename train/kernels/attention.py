"""Attention for every model: `attend(q, k, v, ...)` takes what a layer knows of its call and
chooses the kernel for the platform here, in `route`, and nowhere else.

`jax.nn.dot_product_attention` picks nothing by itself: without `implementation=` it always
takes XLA's path. cuDNN's flash attention, which skips the masked half of a causal product and
never writes the logits to memory, has to be asked for, and only where jax's cuDNN path accepts
the call: an unsupported configuration raises instead of falling back. On a CPU, zoo's own
kernels (`zoo.engine.kernels.attention_cpu`) run what XLA:CPU runs slowly. So `route`, a pure
function of the platform and the call, picks first; `attend` then makes the call it picked.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from zoo.engine.kernels import attention_cpu

Kernel = Literal["cudnn", "xla", "cpu", "cpu_decode", "einsum"]
"""`cudnn`, `xla`: `jax.nn.dot_product_attention(implementation=...)`; `cpu`: zoo's written-out
attention (`attention_cpu.attend`); `cpu_decode`: a decoding step's sums over the cache
(`attention_cpu.attend_one`); `einsum`: attention written out in two einsums, for Dropout on
its weights, soft-capped logits or attention sinks."""

Mask = Literal["none", "causal", "positions"]
"""`none`: every key visible; `causal`: `is_causal=True` and no mask array (cuDNN's causal
mask type: the masked blocks are never computed); `positions`: a boolean mask built from the
queries' and keys' positions (or the cache's own)."""

Dropout = Callable[[jax.Array], jax.Array]
"""Dropout of the attention weights (batch x heads x queries x keys), with its key bound."""

_NO_ATTENTION = -1e30  # a logit that softmax turns into exactly zero weight
FLASH_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class Route:
    """How one attention call runs: which `kernel`, given its causal `mask` which way."""

    kernel: Kernel
    mask: Mask


@dataclasses.dataclass(frozen=True)
class Platform:
    """What the choice depends on in the machine: `backend` as `jax.default_backend()` names
    it; `cuda`: an NVIDIA GPU (a ROCm GPU is also `gpu`, and has no cuDNN); its
    `compute_capability`."""

    backend: str
    cuda: bool = False
    compute_capability: tuple[int, int] | None = None


@functools.cache
def current_platform() -> Platform:
    """The platform of `jax.default_backend()`, where the model's arrays live."""
    backend = jax.default_backend()
    if backend != "gpu":
        return Platform(backend)
    device = jax.devices()[0]
    if "cuda" not in device.client.platform_version:
        return Platform(backend)
    major, minor = (int(part) for part in device.compute_capability.split(".")[:2])
    return Platform(backend, cuda=True, compute_capability=(major, minor))


@dataclasses.dataclass(frozen=True)
class Call:
    """What the choice depends on in the call: queries, keys and values of `dtype`, heads of
    `head_dim`; `causal`: each position sees itself and earlier ones only; `cached`: against a
    key/value cache (decoding); `dropout`: Dropout on the attention weights; `softcap`:
    soft-capped logits; `window`: a sliding window; `packed`: rows of several sequences, each
    attending within itself; `one_query`: one query a row; `grouped`: key/value heads shared
    by groups of query heads; `one_device`: no mesh of more than one device; `sinks`: a sink
    logit per head in each softmax."""

    dtype: jnp.dtype
    head_dim: int
    causal: bool = False
    cached: bool = False
    dropout: bool = False
    softcap: bool = False
    window: bool = False
    packed: bool = False
    one_query: bool = False
    grouped: bool = False
    one_device: bool = True
    sinks: bool = False


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float | None = None,
    causal: bool = False,
    window: int = 0,
    softcap: float = 0.0,
    segments: jax.Array | None = None,
    cache_mask: jax.Array | None = None,
    dropout: Dropout | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """softmax(q.k * scale) . v: queries (batch, queries, heads, features) to keys and values
    (batch, keys, key/value heads, features; grouped-query heads share them). `scale` None:
    1/sqrt(features). `causal`: each query sees itself and earlier positions only; `window`:
    the last `window` of them only (0: all); `softcap`: logits capped at +-softcap by tanh (0:
    none); `segments` (batch x length): a packed row's sequence of each token, which sees its
    own sequence's only; `cache_mask` (batch, 1, queries, keys): which keys of a key/value
    cache each query sees, given when the keys are a cache's; `dropout`: Dropout of the
    attention weights (training); `sinks` (heads): a logit per query head that joins each
    query's softmax with no value (gpt-oss's attention sinks: a head's weights on the keys then
    sum to less than 1). Logits and softmax in float32.

    The kernel, first match wins (`route`):
    1. Dropout on the weights, or sinks: `einsum`, written out, on every platform (the fused
       calls have no Dropout on their weights, nor a sink in their softmax).
    2. A CPU, a decoding step against a cache (one query a row, on one device) whose key/value
       heads are grouped or held in half precision: `cpu_decode`, sums over the cache as it is
       held.
    3. Soft-capped logits: `einsum` (no fused kernel caps them).
    4. A CPU, without a cache or a sliding window (packed rows included): `cpu`, zoo's own,
       a third of XLA's time.
    5. An NVIDIA GPU of compute capability 8.0 or more (not 10.3), bfloat16 or float16, heads
       a multiple of 8 up to 128 (256 from 9.0 on), without a cache or packed rows: `cudnn`,
       flash attention (a causal mask is cuDNN's own, `is_causal`).
    6. Everything else: `xla`, jax's kernel: TPUs, ROCm, float32 on a GPU, other head sizes,
       a cache (with its mask), packed rows, a sliding window on a CPU."""
    call = _call(q, k, causal, cache_mask, dropout, softcap, window, segments, sinks)
    path = route(current_platform(), call)
    if path.kernel == "cpu_decode":
        scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
        return attention_cpu.attend_one(q, k, v, cache_mask, scale=scale, softcap=softcap)
    if call.grouped and (path.kernel in ("einsum", "cpu") or _grouped_fails(q, k)):
        k, v = (_repeat_heads(t, q) for t in (k, v))
    if path.kernel == "cpu":
        causal = path.mask == "causal"
        return attention_cpu.attend(q, k, v, scale=scale, causal=causal, segments=segments)
    visible = _visible(q, k, path.mask, window, segments, cache_mask)
    if path.kernel == "einsum":
        return _written_out(q, k, v, visible, scale, softcap, dropout, sinks)
    return _dot_product_attention(
        q,
        k,
        v,
        mask=visible,
        scale=scale,
        is_causal=path.mask == "causal",
        local_window_size=(window - 1, 0) if window and path.mask == "causal" else None,
        implementation=path.kernel,
    )


def _call(q, k, causal, cache_mask, dropout, softcap, window, segments, sinks) -> Call:
    return Call(
        jnp.dtype(q.dtype),
        q.shape[-1],
        causal=causal,
        cached=cache_mask is not None,
        dropout=dropout is not None,
        softcap=softcap > 0,
        window=window > 0,
        packed=segments is not None,
        one_query=q.shape[1] == 1,
        grouped=k.shape[2] != q.shape[2],
        one_device=jax.sharding.get_abstract_mesh().size <= 1,
        sinks=sinks is not None,
    )


def route(platform: Platform, call: Call) -> Route:
    """The kernel and mask of one attention call, in `attend`'s order. Why each condition (jax
    0.10's cuDNN path, `jax/_src/cudnn/fused_attention_stablehlo.py`, and measurements):
    - `dropout` takes the einsum path on every platform: the fused call has no Dropout on its
      weights (cuDNN has one, but jax does not expose it through `dot_product_attention`).
      `sinks` too: no fused call here takes a logit without a key.
    - `cpu_decode`: on a 2-core CPU, Qwen3-0.6B's decoding (16 query heads, 8 key/value heads)
      at batch 8 ran 1.3x faster in float32 and 1.1x in bfloat16, while GPT-2 small's (12
      heads each their own, float32) ran 1.2x slower than through jax's kernel, whose copies
      are small there.
    - `cpu` leaves a cache to XLA (its mask is an array of positions) and a sliding window
      (the kernel skips keys by blocks of queries, not by distance).
    - `cached` stays on XLA with a positional mask: the queries sit at `start`, `start+1`, ...
      of a longer, partly unwritten cache, which neither causal mask type covers (cuDNN's is
      aligned at position 0), and an explicit mask reaches cuDNN as an additive bias, the
      slower path it was meant to avoid.
    - cuDNN exists on NVIDIA GPUs only: jax raises "cuDNN is not detected" elsewhere, a ROCm
      GPU included. Compute capability 8.0 or more: cuDNN's flash attention kernels are
      Ampere's and later; jax does not check it, so an older GPU would fail when XLA compiles,
      past any fallback. Not 10.3 exactly: there jax needs cuDNN 9.11, and the version is not
      read here. bfloat16 or float16: jax raises for any other dtype (float32 included; fp8
      needs scaling factors zoo does not keep). Heads a multiple of 8, at most 128 (256 from
      Hopper, 9.0, on): jax raises otherwise.
    - `packed` stays on XLA too: the sequences' mask is an array, which `dot_product_attention`
      hands cuDNN as an additive bias, and it exposes no segment ids of cuDNN's.
    No condition on the sequence lengths: jax checks them (even lengths) only for a bias in
    training, and no bias is passed. Nor on sharding: cuDNN's partitioning refuses a split
    sequence or head dimension, and zoo splits only batch and heads."""
    mask = _mask(call)
    cpu = platform.backend == "cpu"
    if call.dropout or call.sinks:
        return Route("einsum", mask)
    if cpu and _decode_step(call):
        return Route("cpu_decode", mask)
    if call.softcap:
        return Route("einsum", mask)
    if cpu and not call.cached and not call.window:
        return Route("cpu", mask)
    if call.cached or call.packed or not _flash_attention_runs(platform, call):
        return Route("xla", mask)
    return Route("cudnn", mask)


def _mask(call: Call) -> Mask:
    """`causal` where the kernel can take the causal mask as a flag; a mask array of positions
    against a cache and on the written-out path."""
    if not call.causal:
        return "none"
    written_out = call.dropout or call.softcap or call.sinks
    return "positions" if call.cached or written_out else "causal"


def _decode_step(call: Call) -> bool:
    grouped_or_half = call.grouped or call.dtype != jnp.float32
    return call.cached and call.one_query and call.one_device and grouped_or_half


def _flash_attention_runs(platform: Platform, call: Call) -> bool:
    capability, head_dim = platform.compute_capability, call.head_dim
    if platform.backend != "gpu" or not platform.cuda or capability is None:
        return False
    if capability < (8, 0) or capability == (10, 3) or call.dtype not in FLASH_DTYPES:
        return False
    return head_dim % 8 == 0 and head_dim <= (256 if capability >= (9, 0) else 128)


def _visible(q, k, mask: Mask, window: int, segments, cache_mask) -> jax.Array | None:
    """The boolean mask (batch or 1, heads or 1, queries, keys) of the keys each query sees,
    None where it sees them all or the kernel masks by itself (`is_causal`)."""
    visible = cache_mask
    if mask == "positions" and visible is None:
        distance = jnp.arange(q.shape[1])[:, None] - jnp.arange(k.shape[1])[None, :]
        visible = ((distance >= 0) & ((distance < window) if window else True))[None, None]
    if segments is not None:  # a packed row's sequences see their own tokens only
        same = (segments[:, :, None] == segments[:, None, :])[:, None]
        visible = same if visible is None else visible & same
    return visible


def _written_out(
    q, k, v, visible, scale, softcap: float, dropout: Dropout | None, sinks: jax.Array | None
) -> jax.Array:
    """Attention in two einsums and a float32 softmax: the path of Dropout on its weights, of
    soft-capped logits and of sinks, which the fused calls lack. A head's sink is one more
    logit in each of its queries' softmax, never masked, whose weight is dropped (it has no
    value), as transformers' `eager_attention_forward` of gpt-oss computes it."""
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
    logits = logits / math.sqrt(q.shape[-1]) if scale is None else logits * scale
    if softcap:
        logits = softcap * jnp.tanh(logits / softcap)
    if visible is not None:
        logits = jnp.where(visible, logits, _NO_ATTENTION)
    if sinks is not None:
        column = jnp.zeros_like(logits[..., :1]) + sinks.astype(jnp.float32)[:, None, None]
        logits = jnp.concatenate([logits, column], axis=-1)
    weights = jax.nn.softmax(logits, axis=-1)
    weights = (weights if sinks is None else weights[..., :-1]).astype(v.dtype)
    if dropout is not None:
        weights = dropout(weights)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def _dot_product_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, mask: jax.Array | None, **options
) -> jax.Array:
    """`jax.nn.dot_product_attention(q, k, v, mask=mask, **options)`, a batch of one unsharded
    first. XLA's kernel reshapes the query to (batch, length, key/value heads, group, features),
    and jax drops the sharding of a dimension of size 1 in such a reshape (a batch of one can be
    sharded only over mesh axes of size 1); jax 0.12 then refuses its product of that query with
    the key, whose batch is still sharded (jax 0.10 takes it). Over axes of size 1 nothing
    moves."""
    if q.shape[0] == 1:
        q, k, v = (_batch_unsharded(t) for t in (q, k, v))
        mask = None if mask is None else _batch_unsharded(mask)
    return jax.nn.dot_product_attention(q, k, v, mask=mask, **options)


def _batch_unsharded(t: jax.Array) -> jax.Array:
    spec = jax.typeof(t).sharding.spec
    if not spec or spec[0] is None:
        return t
    return jax.sharding.reshard(t, P(None, *spec[1:]))


def _grouped_fails(q: jax.Array, k: jax.Array) -> bool:
    """Whether `jax.nn.dot_product_attention` cannot take these grouped heads as they are: it
    splits the query heads into (key/value heads, group) and maps over the group, which fails
    under explicit sharding for a single key/value head (with a mask, or where the mesh axis of
    the heads has size 1) and where the query heads' split does not divide the key/value heads
    (measured, jax 0.10.2); and, in jax 0.12, where the key/value heads are not split as the
    query heads are (whole beside split ones): its product of the two then pairs heads sharded
    differently, which explicit sharding refuses there."""
    groups = k.shape[2]
    if groups == 1:
        return True
    axes = jax.typeof(q).sharding.spec[2]
    if _as_tuple(axes or ()) != _as_tuple(jax.typeof(k).sharding.spec[2] or ()):
        return True
    if axes is None:
        return False
    mesh = jax.sharding.get_abstract_mesh()
    return groups % math.prod(mesh.shape[a] for a in _as_tuple(axes)) != 0


def _as_tuple(axes: str | tuple[str, ...]) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _repeat_heads(t: jax.Array, q: jax.Array) -> jax.Array:
    """Key or value heads `t` repeated to one per query head of `q` (grouped-query attention is
    multi-head attention with each key/value head repeated for its group), placed as `q` is."""
    batch, length, groups, head_dim = t.shape
    per_group = q.shape[2] // groups
    wide = jnp.broadcast_to(t[:, :, :, None, :], (batch, length, groups, per_group, head_dim))
    spec = jax.typeof(q).sharding.spec
    return jnp.reshape(wide, (batch, length, q.shape[2], head_dim), out_sharding=spec)

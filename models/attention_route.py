"""Which kernel computes the shared block's attention, and how its mask is given.

`jax.nn.dot_product_attention` picks nothing by itself: without `implementation=` it always
takes XLA's path. cuDNN's flash attention, which skips the masked half of a causal product
and never writes the logits to memory, has to be asked for, and only where jax's cuDNN path
accepts the call: an unsupported configuration raises instead of falling back. So the block
asks `route` first, a pure function of the platform and the call, then makes the call through
`dot_product_attention`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

Kernel = Literal["cudnn", "xla", "einsum"]
"""`cudnn`, `xla`: `jax.nn.dot_product_attention(implementation=...)`; `einsum`: attention
written out, for Dropout on its weights."""

Mask = Literal["none", "causal", "positions"]
"""`none`: every key visible; `causal`: `is_causal=True` and no mask array (cuDNN's causal
mask type: the masked blocks are never computed); `positions`: a boolean mask built from the
queries' and keys' positions."""


@dataclasses.dataclass(frozen=True)
class Route:
    """How one attention call runs: which `kernel`, given its causal `mask` which way."""

    kernel: Kernel
    mask: Mask


@dataclasses.dataclass(frozen=True)
class Platform:
    """What cuDNN support depends on: `backend` as `jax.default_backend()` names it; `cuda`:
    an NVIDIA GPU (a ROCm GPU is also `gpu`, and has no cuDNN); its `compute_capability`."""

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


FLASH_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def route(
    platform: Platform,
    dtype: jnp.dtype,
    head_dim: int,
    *,
    causal: bool,
    cached: bool,
    dropout: bool,
    packed: bool = False,
) -> Route:
    """The kernel and mask of one attention call: queries, keys and values of `dtype` with
    heads of `head_dim`; `causal`: each position sees itself and earlier ones only; `cached`:
    against a key/value cache (decoding); `dropout`: Dropout on the attention weights;
    `packed`: rows of several sequences, each attending within itself.

    Why each condition (jax 0.10's cuDNN path, `jax/_src/cudnn/fused_attention_stablehlo.py`):
    - `dropout` takes the einsum path on every platform: the fused call has no Dropout on its
      weights (cuDNN has one, but jax does not expose it through `dot_product_attention`).
    - `cached` stays on XLA with a positional mask: the queries sit at `start`, `start+1`, ...
      of a longer, partly unwritten cache, which neither causal mask type covers (cuDNN's is
      aligned at position 0), and an explicit mask reaches cuDNN as an additive bias, the
      slower path it was meant to avoid.
    - a CUDA GPU only: cuDNN exists on NVIDIA GPUs; jax raises "cuDNN is not detected"
      elsewhere, a ROCm GPU included.
    - compute capability 8.0 or more: cuDNN's flash attention kernels are Ampere's and later;
      jax does not check it, so an older GPU would fail when XLA compiles, past any fallback.
      Not 10.3 exactly: there jax needs cuDNN 9.11, and the version is not read here.
    - bfloat16 or float16: jax raises for any other dtype (float32 included; fp8 needs
      scaling factors the block does not keep).
    - a head dimension that is a multiple of 8 and at most 128 (256 from Hopper, 9.0, on):
      jax raises otherwise.
    - `packed` (rows of several sequences, each attending within itself only) stays on XLA
      too: the sequences' mask is an array, which `dot_product_attention` hands cuDNN as an
      additive bias, and it exposes no segment ids of cuDNN's.
    No condition on the sequence lengths: jax checks them (even lengths) only for a bias in
    training, and the block passes no bias. Nor on sharding: cuDNN's partitioning refuses a
    split sequence or head dimension, and the block splits only batch and heads."""
    mask: Mask = "none"
    if causal:
        mask = "positions" if cached or dropout else "causal"
    if dropout:
        return Route("einsum", mask)
    if cached or packed or not _flash_attention_runs(platform, jnp.dtype(dtype), head_dim):
        return Route("xla", mask)
    return Route("cudnn", mask)


def _flash_attention_runs(platform: Platform, dtype: jnp.dtype, head_dim: int) -> bool:
    capability = platform.compute_capability
    if platform.backend != "gpu" or not platform.cuda or capability is None:
        return False
    if capability < (8, 0) or capability == (10, 3) or dtype not in FLASH_DTYPES:
        return False
    return head_dim % 8 == 0 and head_dim <= (256 if capability >= (9, 0) else 128)


def dot_product_attention(
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

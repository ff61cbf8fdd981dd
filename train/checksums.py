"""Checksums of a checkpoint's arrays, so that a flipped bit on disk is caught at restore.

Orbax and TensorStore check the index of each stored array, not its data: a bit flipped in a
parameter's bytes is read back as a slightly different number. So every save records, in the
checkpoint's JSON metadata, a 32-bit checksum of each array, computed on the devices from the
arrays being saved; every restore computes it again from the arrays read back and compares.

The checksum of an array is the sum, modulo 2**32, over its elements of a mixing hash (MurmurHash3's
finaliser) of the element's bits and its (Fibonacci-hashed) position. A sum of integers does not depend on the order
of addition, so the checksum is the same whatever the mesh the array is sharded over, and it is
computed where the array lives, shard by shard, without gathering it. One changed element always
changes it (the hash is a bijection of the bits); damage spread over several elements goes
unnoticed with probability about 2**-32. It guards against bit rot and truncated copies, not
against deliberate tampering.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

_GOLDEN = 0x9E3779B9  # 2**32 / the golden ratio: Fibonacci hashing of positions


def _mix(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finaliser: a bijection whose every output bit depends on every
    input bit."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _words(x: jax.Array) -> jax.Array:
    """The array's bits as uint32 words (64-bit elements as two words on a new last axis)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    size = x.dtype.itemsize
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _checksum(x: jax.Array) -> jax.Array:
    words = _words(x)
    if words.ndim == 0:
        return _mix(words)
    sharding = jax.typeof(words).sharding
    position = jnp.zeros(words.shape, jnp.uint32, out_sharding=sharding)
    stride = 1
    for axis in reversed(range(words.ndim)):
        index = jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis, out_sharding=sharding)
        position = position + index * jnp.uint32(stride % 2**32)
        stride *= words.shape[axis]
    # Fibonacci hashing spreads the positions; the mix of (bits ^ that) is, for each position,
    # a bijection of the bits.
    return jnp.sum(_mix(words ^ (position * jnp.uint32(_GOLDEN))), dtype=jnp.uint32)


# One small program per shape, dtype and sharding, shared by every array that has them (a
# model's layers, its biases), rather than one program over every array of the state: a run's
# first save compiles much less (the resnet18 fixture's 229 arrays on 8 CPU devices, 23 distinct:
# 1.1-1.3 s, against 2.4 s as one program), and a large state's checksums run faster (README,
# "What checksums cost"), for one dispatch per array at each save.
_checksum_jitted = jax.jit(_checksum)


def checksums(arrays: Mapping[str, jax.Array]) -> dict[str, int]:
    """`{name: checksum}` of each array (computed on its devices, then fetched together)."""
    computed = {name: _checksum_jitted(x) for name, x in arrays.items()}
    return {name: int(value) for name, value in jax.device_get(computed).items()}


def flat(tree: object, prefix: str = "") -> dict[str, jax.Array]:
    """The arrays of a pytree (an `nnx.State`, a dict of metric sums) by their path,
    `prefix/0/head/kernel`: the names checksums are recorded and looked up under."""
    arrays = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = [
            str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))) for key in path
        ]
        if parts and parts[-1] == "value":  # an NNX Variable's payload
            parts = parts[:-1]
        arrays["/".join([prefix, *parts] if prefix else parts)] = leaf
    return arrays


def mismatches(expected: Mapping[str, int], arrays: Mapping[str, jax.Array]) -> list[str]:
    """The names of the arrays whose checksum differs from the one recorded (arrays with none
    recorded are not compared)."""
    known = {name: x for name, x in arrays.items() if name in expected}
    return sorted(name for name, value in checksums(known).items() if value != expected[name])

"""Checksums of a checkpoint's arrays, so that a flipped bit on disk is caught at restore.

Orbax and TensorStore check the index of each stored array, not its data: a bit flipped in a
parameter's bytes is read back as a slightly different number. So every save records, in the
checkpoint's JSON metadata, a 32-bit checksum of each array, computed on the devices from the
arrays being saved; every restore computes it again from the arrays read back and compares.

The checksum of an array is the sum, modulo 2**32, over its elements of a mixing hash
(MurmurHash3's finaliser) of the element's bits and its (Fibonacci-hashed) position. A sum of
integers does not depend on the order of addition, so the checksum is the same whatever the mesh
the array is sharded over, and it is computed where the array lives, each device summing its own
shard, without gathering it. One changed element always changes it (the hash is a bijection of
the bits); damage spread over several elements goes unnoticed with probability about 2**-32. It
guards against bit rot and truncated copies, not against deliberate tampering.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

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


def _positions(shape: tuple[int, ...], full_shape: tuple[int, ...], offsets) -> jax.Array:
    """Each element's row-major index in the full array (mod 2**32), for a block of `shape`
    that starts at `offsets` (one per axis, uint32 scalars or 0) in an array of `full_shape`."""
    position = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        index = jax.lax.broadcasted_iota(jnp.uint32, shape, axis) + offsets[axis]
        position = position + index * jnp.uint32(stride % 2**32)
        stride *= full_shape[axis]
    return position


def _hash_sum(words: jax.Array, position: jax.Array) -> jax.Array:
    # Fibonacci hashing spreads the positions; the mix of (bits ^ that) is, for each position,
    # a bijection of the bits.
    return jnp.sum(_mix(words ^ (position * jnp.uint32(_GOLDEN))), dtype=jnp.uint32)


def _checksum(x: jax.Array) -> jax.Array:
    """The checksum of an array that is whole on each of its devices."""
    words = _words(x)
    if words.ndim == 0:
        return _mix(words)
    return _hash_sum(words, _positions(words.shape, words.shape, (0,) * words.ndim))


def _block_sum(block: jax.Array, *, shape, spec, mesh_axes) -> jax.Array:
    """One device's share of the checksum of a sharded array: the sum over its block, at the
    block's place in the whole; zero on the devices that hold a copy of a block that another
    device (index 0 along the mesh axes the array is not split over) already counts."""
    words = _words(block)
    full_shape = tuple(shape) + words.shape[len(shape) :]  # 64-bit elements: 2 words each
    offsets = [0] * words.ndim
    for axis, names in enumerate(spec):
        if names is not None:
            offsets[axis] = jax.lax.axis_index(names).astype(jnp.uint32) * jnp.uint32(
                words.shape[axis]
            )
    share = _hash_sum(words, _positions(words.shape, full_shape, offsets))
    split = {name for names in spec if names is not None for name in _names(names)}
    for name in mesh_axes:
        if name not in split:
            share = jnp.where(jax.lax.axis_index(name) == 0, share, jnp.uint32(0))
    return share.reshape((1,) * len(mesh_axes))


def _names(entry) -> tuple[str, ...]:
    return entry if isinstance(entry, tuple) else (entry,)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _block_sums(x: jax.Array, mesh: jax.sharding.Mesh, spec: P) -> jax.Array:
    body = functools.partial(_block_sum, shape=x.shape, spec=spec, mesh_axes=mesh.axis_names)
    out_spec = P(*mesh.axis_names)
    return jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=out_spec)(x)


_checksum_jitted = jax.jit(_checksum)


def _dispatch(x: jax.Array) -> jax.Array:
    """The checksum of `x` (of a sharded `x`: each device's share of it), computed where `x`
    lives, by a small program per shape, dtype and sharding.

    One program per shape rather than one over the whole state: a run's first save compiles
    much less (the resnet18 fixture's 229 arrays on 8 CPU devices, 23 distinct: 1.1-1.3 s,
    against 2.4 s as one program), and a large state's checksums run faster (README, "What
    checksums cost"). The shares are summed on the host, not by an all-reduce, so these
    programs have no collectives: XLA:CPU runs each device's part of a program on a pool of
    one thread per device, where a part waiting for its peers in a collective holds a thread
    that another program's part may need; a few hundred independent collective programs in a
    row deadlocked it (8 simulated devices, tests/train/test_checksums.py)."""
    sharding = getattr(x, "sharding", None)  # None: a host array
    if isinstance(sharding, NamedSharding) and any(e is not None for e in sharding.spec):
        return _block_sums(x, sharding.mesh, sharding.spec)
    return _checksum_jitted(x)


def checksums(arrays: Mapping[str, jax.Array]) -> dict[str, int]:
    """`{name: checksum}` of each array: computed on its devices, the shares this process holds
    fetched together and added, then (several processes) added across processes in one
    exchange. Jitted even in a `trainer.debug` run, which runs the model's steps un-jitted:
    op by op, a small run's checksums took 30 s a save."""
    names = list(arrays)
    with jax.disable_jit(False):
        results = [_dispatch(arrays[name]) for name in names]
    counted = [_counted_here(arrays[name], result) for name, result in zip(names, results)]
    fetched = jax.device_get(counted)
    local = np.array([np.sum(pieces, dtype=np.uint32) for pieces in fetched], dtype=np.uint32)
    if jax.process_count() > 1:
        local = np.sum(multihost_utils.process_allgather(local), axis=0, dtype=np.uint32)
    return {name: int(value) for name, value in zip(names, local)}


def _counted_here(x: jax.Array, result: jax.Array) -> list:
    """What this process adds to the checksum of `x`: its devices' shares of a sharded array;
    of an array whole on each device, its checksum from the process of the array's first
    device (once over all processes), nothing from the others."""
    if result.ndim:  # the shares of `_block_sums`, deduplicated on the devices
        return [shard.data for shard in result.addressable_shards]
    if not isinstance(x, jax.Array):  # a host array: one process
        return [result]
    first = min(x.sharding.device_set, key=lambda device: device.id)
    return [result.addressable_shards[0].data] if first.process_index == jax.process_index() else []


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

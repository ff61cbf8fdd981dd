"""Checkpoint checksums (`zoo.engine.checkpoints.checksums`): the same number for an array wherever and however
it is sharded, equal to a plain numpy computation of the documented hash; and many of them in a
row on a 2x2x2 mesh of CPU devices without XLA:CPU's collective deadlock."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from zoo.engine.checkpoints import checksums

MESH_AXES = ("data", "fsdp", "tensor")
SPECS = [P(), P("fsdp"), P(None, "tensor"), P("fsdp", "tensor"), P(("data", "fsdp"), "tensor")]


def mix(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def reference(x: np.ndarray) -> int:
    """The module docstring's checksum, in numpy: over the array's bits as 32-bit words in
    row-major order, the sum mod 2**32 of mix(word ^ position * 0x9E3779B9)."""
    x = np.asarray(x)
    if x.dtype == np.bool_:
        x = x.astype(np.uint8)
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[x.dtype.itemsize]
    words = np.ascontiguousarray(x).view(unsigned).astype(np.uint32)
    if words.ndim == 0:
        return int(mix(words))
    flat = words.reshape(-1)
    position = (np.arange(flat.size, dtype=np.uint64) % 2**32).astype(np.uint32)
    with np.errstate(over="ignore"):
        return int(np.sum(mix(flat ^ (position * np.uint32(0x9E3779B9))), dtype=np.uint32))


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 2, 2), MESH_AXES, axis_types=(jax.sharding.AxisType.Explicit,) * 3)


def arrays_of_every_kind():
    values = np.arange(16 * 24, dtype=np.float32).reshape(16, 24) * 0.37 - 9.0
    return {
        "float32": values,
        "bfloat16": values.astype(jnp.bfloat16),
        "int8": (values % 100).astype(np.int8),
        "bool": values > 0,
        "uint32": values.astype(np.uint32),
    }


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_a_checksum_is_the_reference_whatever_the_sharding(mesh, spec):
    host = arrays_of_every_kind()
    placed = {n: jax.device_put(x, NamedSharding(mesh, spec)) for n, x in host.items()}
    one_device = {n: jax.device_put(x, jax.devices()[0]) for n, x in host.items()}
    expected = {n: reference(x) for n, x in host.items()}
    assert checksums.checksums(placed) == expected
    assert checksums.checksums(one_device) == expected


def test_scalars_keys_and_vectors(mesh):
    keys = jax.random.split(jax.random.key(3), 8)
    arrays = {
        "scalar": jax.device_put(np.float32(2.5), NamedSharding(mesh, P())),
        "vector": jax.device_put(np.arange(8, dtype=np.int32), NamedSharding(mesh, P("data"))),
        "keys": jax.device_put(keys, NamedSharding(mesh, P(("data", "fsdp", "tensor")))),
    }
    expected = {
        "scalar": reference(np.float32(2.5)),
        "vector": reference(np.arange(8, dtype=np.int32)),
        "keys": reference(np.asarray(jax.random.key_data(keys))),
    }
    assert checksums.checksums(arrays) == expected


def test_one_changed_element_changes_it(mesh):
    values = np.linspace(-1, 1, 16 * 24, dtype=np.float32).reshape(16, 24)
    flipped = values.copy()
    flipped.view(np.uint32)[11, 17] ^= 1 << 20
    sharding = NamedSharding(mesh, P("fsdp", "tensor"))
    a, b = (jax.device_put(x, sharding) for x in (values, flipped))
    assert checksums.checksums({"x": a}) != checksums.checksums({"x": b})


def test_hundreds_of_sharded_arrays_in_a_row_do_not_deadlock(mesh):
    """A save's checksums are one dispatch per array; as collective programs, a few hundred
    of them in a row deadlocked XLA:CPU's rendezvous (aborting the process) within the first
    rounds here."""
    arrays, k = {}, 0
    for shape in [(16, 32), (32, 16), (8, 8), (64, 8), (16,)]:
        for spec in SPECS:
            if len(spec) <= len(shape):
                for _ in range(8):
                    k += 1
                    x = np.full(shape, k, np.float32)
                    arrays[str(k)] = jax.device_put(x, NamedSharding(mesh, spec))
    expected = {name: reference(np.asarray(x)) for name, x in arrays.items()}
    for _ in range(5):
        assert checksums.checksums(arrays) == expected


def test_a_host_array_has_the_checksum_of_the_same_array_on_devices(mesh):
    values = np.arange(48, dtype=np.float32).reshape(6, 8)
    placed = jax.device_put(values, NamedSharding(mesh, P(None, "tensor")))
    assert checksums.checksums({"x": values}) == checksums.checksums({"x": placed})

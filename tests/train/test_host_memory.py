"""Host buffers for a checkpoint fill (`zoo.engine.weights.host_memory`): pages readied on a thread, carved
into page-aligned, zeroed buffers that jax on CPU adopts without a copy; what is left over goes
back to the kernel."""

import jax
import numpy as np
from zoo.engine.weights.host_memory import PAGE, Prefaulted, page_buffer

MIB = 2**20


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def test_buffers_are_zeroed_page_aligned_and_apart():
    memory = Prefaulted(4 * MIB)
    shapes = [((3, 5), np.float32), ((1000,), np.int8), ((7, 300), np.float32), ((), np.float32)]
    buffers = [memory.take(shape, dtype) for shape, dtype in shapes]
    memory.wait()
    for buffer, (shape, dtype) in zip(buffers, shapes, strict=True):
        assert buffer.shape == shape and buffer.dtype == dtype
        assert buffer.ctypes.data % PAGE == 0
        assert not buffer.any()
        buffer[...] = 1
    assert all((b == 1).all() for b in buffers)  # no buffer overlaps another


def test_past_its_size_it_gives_buffers_of_their_own():
    memory = Prefaulted(2 * PAGE)
    first = memory.take((PAGE // 4,), np.float32)  # one page
    second = memory.take((PAGE // 2,), np.float32)  # two pages: more than is left
    third = memory.take((PAGE // 4,), np.float32)  # the last page
    assert not np.shares_memory(first, second) and not np.shares_memory(second, third)
    assert third.ctypes.data == first.ctypes.data + PAGE
    assert second.ctypes.data % PAGE == 0 and not second.any()


def test_the_rest_is_given_back():
    start = resident_bytes()
    memory = Prefaulted(256 * MIB)
    kept = memory.take((MIB,), np.float32)  # 4 MiB
    memory.wait()
    assert resident_bytes() - start > 200 * MIB
    memory.release_rest()
    assert resident_bytes() - start < 16 * MIB
    assert not kept.any()


def test_jax_on_cpu_adopts_a_buffer_without_a_copy():
    memory = Prefaulted(MIB)
    for new_buffer in (memory.take, page_buffer):
        buffer = new_buffer((64, 128), np.float32)
        memory.wait()
        buffer[...] = np.arange(buffer.size).reshape(buffer.shape)
        device = jax.devices()[0]
        sharding = jax.sharding.SingleDeviceSharding(device)
        array = jax.make_array_from_callback(buffer.shape, sharding, lambda _, b=buffer: b)
        assert array.unsafe_buffer_pointer() == buffer.ctypes.data
        np.testing.assert_array_equal(np.asarray(array), buffer)

"""A bfloat16 product of a few rows by a kernel held outputs first, on a CPU with AVX-512 BF16:
the products of a decoding step.

XLA:CPU (jaxlib 0.10.2) converts both operands of a bfloat16 product of a few rows to float32
before multiplying, so a bfloat16 decoding step rewrites every weight it reads and runs several
times slower than a float32 one. `bf16_rows.cc`, an XLA FFI handler, multiplies them on the
CPU's bfloat16 dot-product instructions instead, reading each weight once, its work split over
XLA's intra-op threads. It is compiled with the machine's C++ compiler (`$CXX`, else `c++`)
the first time a process needs it, into zoo's kernel cache, and registered with `jax.ffi`.

The arithmetic is XLA's bfloat16 product's (bfloat16 operands, float32 sums, one rounding to
nearest, ties to even); only the order of the sums differs, so logits agree with XLA's to
float32 rounding, not to the bit, and subnormal numbers (below 2^-126) count as zero, as the
CPU's instruction takes them. Each row's sums run in one order whatever the other rows are, so
a row decoded in a batch has the bits it has decoded alone. `zoo.engine.kernels.dense` takes it for
products of at most `FEW_ROWS` rows; where it cannot run (a CPU without AVX-512 BF16, no
compiler, a multi-device mesh, `ZOO_NATIVE_KERNELS=0`), the product is XLA's, as before."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
from jax.sharding import PartitionSpec as P
from zoo.engine.errors import ZooError

log = logging.getLogger("zoo")

SOURCE = Path(__file__).with_name("bf16_rows.cc")
TARGET = "zoo_bf16_rows"
SWITCH_ENV = "ZOO_NATIVE_KERNELS"
"""`0` turns the kernel off (XLA's product everywhere)."""
CACHE_ENV = "ZOO_KERNEL_DIR"
"""Where compiled kernels are kept; else `$XDG_CACHE_HOME/zoo/kernels` (`~/.cache/zoo/kernels`)."""
FLAGS = ("-O3", "-std=c++17", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16")


def applies(x: jax.Array, kernel: jax.Array) -> bool:
    """Whether `product(x, kernel, ...)` can take the kernel: both bfloat16, on a CPU that runs
    it, outside a multi-device mesh."""
    return (
        x.dtype == kernel.dtype == jnp.bfloat16
        and x.size > 0
        and jax.default_backend() == "cpu"
        and all(_on_one_device(a) for a in (x, kernel))
        and available()
    )


def _on_one_device(a: jax.Array) -> bool:
    """Whether `a` is traced outside a mesh of several devices (the kernel is not partitioned)."""
    mesh = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
    return jax.sharding.get_abstract_mesh().size <= 1 and (mesh is None or mesh.size <= 1)


def _whole(a: jax.Array) -> jax.Array:
    """`a` typed as one whole array: on a mesh of one device, its axes named (each of size 1)
    would make the reshapes to the kernel's matrices ask for their shardings."""
    mesh = getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
    return a if mesh is None or mesh.empty else jax.sharding.reshard(a, P())


def product(
    x: jax.Array, kernel: jax.Array, inputs: int = 1, out_sharding: Any = None
) -> jax.Array:
    """x (batch..., inputs...) . kernel (outputs..., inputs...) over the last `inputs` axes of
    both, in bfloat16 (see the module's doc; check `applies` first). Its gradient is XLA's
    product's."""
    batch, outputs = x.shape[: x.ndim - inputs], kernel.shape[: kernel.ndim - inputs]
    x, kernel = _whole(x), _whole(kernel)
    flat = _product(x.reshape(math.prod(batch), -1), kernel.reshape(math.prod(outputs), -1))
    y = flat.reshape(*batch, *outputs)
    # On a mesh of one device, the output's spec (its axes named, each of size 1) as asked.
    return y if out_sharding is None else jax.sharding.reshard(y, out_sharding)


@jax.custom_vjp
def _product(x: jax.Array, kernel: jax.Array) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[0], kernel.shape[0]), jnp.bfloat16)
    return jax.ffi.ffi_call(TARGET, out)(x, kernel)


def _reference(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """The same product as XLA computes it (operands widened to float32)."""
    product = jax.lax.dot_general(
        x, kernel, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )
    return product.astype(jnp.bfloat16)


def _forward(x, kernel):
    return _product(x, kernel), (x, kernel)


def _backward(residuals, dy):
    return jax.vjp(_reference, *residuals)[1](dy)


_product.defvjp(_forward, _backward)


@functools.cache
def available() -> bool:
    """Whether this process can run the kernel: compiled (or found compiled) and registered."""
    switch = os.environ.get(SWITCH_ENV, "1")
    if switch not in ("0", "1"):
        raise ZooError(
            f"{SWITCH_ENV}={switch!r} is not a setting zoo knows: 0 turns its bfloat16 CPU "
            "kernel off (XLA's product everywhere), 1 (or leaving it unset) lets it run."
        )
    if switch == "0":
        return False
    if not _cpu_has_bf16_dot():
        return False
    try:
        library = ctypes.CDLL(str(_compiled()))
    except (OSError, subprocess.SubprocessError) as e:
        log.warning(
            "bfloat16 decoding on this CPU runs at XLA's speed (several times slower than "
            "float32): zoo's bfloat16 kernel could not be compiled (%s). Install a C++ "
            "compiler (g++ 10 or newer) or set CXX; %s=0 silences this.",
            e,
            SWITCH_ENV,
        )
        return False
    if not library.ZooBf16Supported():
        return False
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.ZooBf16Rows), platform="cpu")
    return True


def _cpu_has_bf16_dot() -> bool:
    """Whether the CPU has AVX-512 BF16 (x86-64 Linux, `avx512_bf16` in /proc/cpuinfo): on any
    other CPU the kernel is neither compiled nor taken, silently."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(line.startswith("flags") and "avx512_bf16" in line for line in info.splitlines())


def _compiled() -> Path:
    """The kernel's shared library, compiled into the cache unless it is there: named by the
    source, the flags, the compiler and jaxlib's version, written whole or not at all."""
    compiler = _compiler()
    if compiler is None:
        raise OSError("no C++ compiler found (c++, g++, $CXX)")
    key = hashlib.sha256(SOURCE.read_bytes())
    key.update("\0".join((*FLAGS, compiler, jaxlib.__version__)).encode())
    target = _cache_dir() / f"bf16_rows-{key.hexdigest()[:24]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        command = [compiler, *FLAGS, "-fPIC", "-shared", "-w", "-I", jax.ffi.include_dir()]
        command += [str(SOURCE), "-o", str(built)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
        if done.returncode != 0:
            raise OSError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(built, target)
    return target


def _compiler() -> str | None:
    """The C++ compiler the kernel is compiled with: `$CXX`, else `c++`, else `g++`."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache_home) / "zoo" / "kernels"

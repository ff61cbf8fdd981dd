"""A bfloat16 product of a few rows by a kernel held outputs first, on an x86-64 CPU with AVX2 or
AVX-512: the products of a decoding step.

XLA:CPU (jaxlib 0.10.2) converts both operands of a bfloat16 product of a few rows to float32
before multiplying, so a bfloat16 decoding step rewrites every weight it reads and runs several
times slower than a float32 one. `bf16_rows.cc`, an XLA FFI handler, multiplies them reading each
weight once, as bfloat16, its work split over XLA's intra-op threads, in one of three variants
(`VARIANTS`), the first the CPU runs (`/proc/cpuinfo`'s flags, checked again by the library):
`avx512_bf16` on the CPU's bfloat16 dot products; `avx512f` (AVX-512 F and BW) and `avx2` (AVX2
and FMA), each bfloat16 widened to float32 by a 16-bit shift and multiplied with float32 FMAs,
reading half the bytes of a float32 product. `ZOO_NATIVE_KERNELS` names one to force it.

The variant is compiled with the machine's C++ compiler (`$CXX`, else `c++`, else `g++`) the first
time a process needs it, into zoo's kernel cache, and registered with `jax.ffi`. The cache is
trusted by content: a library's file name carries the SHA-256 of its bytes, taken when it was
built, and a process loads it only after hashing the file again and finding that digest (a file
changed since is compiled again, with a warning, and never loaded), from a directory that no other
user can write to (else the kernel is compiled into a private temporary directory for the
process). The name's first part keys the build: the source's hash, the flags, the variant, the
first line of the compiler's `--version` and jaxlib's version, so that an upgrade of any of them
compiles again.

The arithmetic is XLA's bfloat16 product's (bfloat16 operands, float32 sums, one rounding to
nearest, ties to even); only the order of the sums differs, so logits agree with XLA's to float32
rounding, not to the bit. `avx512_bf16` counts subnormal numbers (below 2^-126) as zero, as the
CPU's instruction takes them; the widening variants keep them, as XLA does. Each row's sums run in
one order whatever the other rows are, so a row decoded in a batch has the bits it has decoded
alone. `zoo.engine.kernels.dense` takes it for products of at most `FEW_ROWS` rows; where no
variant can run (another CPU, no compiler, `ZOO_NATIVE_KERNELS=0`) a decoding session multiplies
float32 copies of its weights instead (`zoo.engine.kernels.widened`), and on a mesh of several
devices the product is XLA's."""

from __future__ import annotations

import ctypes
import dataclasses
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
"""The FFI target's name; each variant registers `TARGET_<variant>`."""
SWITCH_ENV = "ZOO_NATIVE_KERNELS"
"""`0` turns the kernel off, `1` (or unset) takes the best variant the CPU runs, a variant's name
takes that one."""
CACHE_ENV = "ZOO_KERNEL_DIR"
"""Where compiled kernels are kept; else `$XDG_CACHE_HOME/zoo/kernels` (`~/.cache/zoo/kernels`)."""
FLAGS = ("-O3", "-std=c++17")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One build of the kernel: the `/proc/cpuinfo` flags it needs and its compiler flags."""

    cpu_flags: tuple[str, ...]
    flags: tuple[str, ...]


VARIANTS = {
    "avx512_bf16": Variant(
        ("avx512f", "avx512bw", "avx512_bf16"),
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-DZOO_AVX512_BF16"),
    ),
    "avx512f": Variant(("avx512f", "avx512bw"), ("-mavx512f", "-mavx512bw", "-DZOO_AVX512F")),
    "avx2": Variant(("avx2", "fma"), ("-mavx2", "-mfma", "-DZOO_AVX2")),
}
"""The kernel's variants, fastest first."""


def applies(x: jax.Array, kernel: jax.Array) -> bool:
    """Whether `product(x, kernel, ...)` can take the kernel: both bfloat16, on a CPU that runs
    one of its variants, outside a multi-device mesh."""
    return (
        x.dtype == kernel.dtype == jnp.bfloat16
        and x.size > 0
        and jax.default_backend() == "cpu"
        and all(_on_one_device(a) for a in (x, kernel))
        and chosen() is not None
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
    x: jax.Array,
    kernel: jax.Array,
    inputs: int = 1,
    out_sharding: Any = None,
    variant: str | None = None,
) -> jax.Array:
    """x (batch..., inputs...) . kernel (outputs..., inputs...) over the last `inputs` axes of
    both, in bfloat16, on `variant` (else the one `chosen()`; see the module's doc and check
    `applies` first). Its gradient is XLA's product's."""
    variant = variant or chosen()
    if variant is None or not load(variant):
        raise ZooError(f"zoo's bfloat16 kernel ({variant or 'no variant'}) cannot run here")
    batch, outputs = x.shape[: x.ndim - inputs], kernel.shape[: kernel.ndim - inputs]
    x, kernel = _whole(x), _whole(kernel)
    rows, columns = x.reshape(math.prod(batch), -1), kernel.reshape(math.prod(outputs), -1)
    y = _product(rows, columns, f"{TARGET}_{variant}").reshape(*batch, *outputs)
    # On a mesh of one device, the output's spec (its axes named, each of size 1) as asked.
    return y if out_sharding is None else jax.sharding.reshard(y, out_sharding)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _product(x: jax.Array, kernel: jax.Array, target: str) -> jax.Array:
    out = jax.ShapeDtypeStruct((x.shape[0], kernel.shape[0]), jnp.bfloat16)
    return jax.ffi.ffi_call(target, out)(x, kernel)


def _reference(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """The same product as XLA computes it (operands widened to float32)."""
    product = jax.lax.dot_general(
        x, kernel, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )
    return product.astype(jnp.bfloat16)


def _forward(x, kernel, target):
    return _product(x, kernel, target), (x, kernel)


def _backward(target, residuals, dy):
    return jax.vjp(_reference, *residuals)[1](dy)


_product.defvjp(_forward, _backward)


@functools.cache
def chosen() -> str | None:
    """The variant this process's decoding products take (compiled, checked and registered), or
    None where none can run: `ZOO_NATIVE_KERNELS` read once."""
    switch = os.environ.get(SWITCH_ENV, "1")
    if switch not in ("0", "1", *VARIANTS):
        raise ZooError(
            f"{SWITCH_ENV}={switch!r} is not a setting zoo knows: 0 turns its bfloat16 CPU "
            "kernel off, 1 (or leaving it unset) takes the best variant this CPU runs, and "
            f"{', '.join(VARIANTS)} take that variant."
        )
    if switch == "0":
        return None
    if switch in VARIANTS and (lacking := missing(switch)):
        raise ZooError(
            f"{SWITCH_ENV}={switch} asks for a kernel this CPU cannot run: it lacks "
            f"{', '.join(lacking)} in /proc/cpuinfo's flags. Variants it runs: "
            f"{', '.join(runnable()) or 'none'} (or 1 for the best of them, 0 for none)."
        )
    candidates = [switch] if switch in VARIANTS else runnable()
    for variant in candidates:
        if load(variant):
            return variant
    if failures := [_FAILURES[v] for v in candidates if v in _FAILURES]:
        log.warning(
            "zoo's bfloat16 kernel could not be compiled for this CPU (%s), so bfloat16 "
            "decoding multiplies float32 copies of the weights instead: float32's speed, the "
            "copies taking twice the bfloat16 weights' memory. Install a C++ compiler (g++ 10 "
            "or newer) or set CXX; %s=0 silences this.",
            failures[0],
            SWITCH_ENV,
        )
    return None


def runnable() -> list[str]:
    """The variants this CPU runs, fastest first."""
    return [name for name in VARIANTS if not missing(name)]


def missing(variant: str) -> tuple[str, ...]:
    """The `/proc/cpuinfo` flags `variant` needs that this CPU lacks."""
    flags = _cpu_flags()
    return tuple(flag for flag in VARIANTS[variant].cpu_flags if flag not in flags)


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The CPU's flags on x86-64 Linux (`/proc/cpuinfo`); none elsewhere, where no variant runs
    and nothing is compiled, silently."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return frozenset()
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in info.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


_FAILURES: dict[str, str] = {}
"""Why a variant could not be compiled or loaded, by variant (`chosen` warns with it)."""


@functools.cache
def load(variant: str) -> bool:
    """Whether `variant` is compiled (or found compiled and intact), loaded, runs on this CPU
    and is registered with `jax.ffi`."""
    try:
        library = _library(variant)
    except (OSError, subprocess.SubprocessError) as e:
        _FAILURES[variant] = str(e)
        return False
    if not library.ZooBf16Supported():
        return False
    capsule = jax.ffi.pycapsule(library.ZooBf16Rows)
    jax.ffi.register_ffi_target(f"{TARGET}_{variant}", capsule, platform="cpu")
    return True


def _library(variant: str) -> ctypes.CDLL:
    """`variant`'s library, loaded from the cache where a build of the same key is there intact
    (its bytes hash to the digest in its name), else compiled there first. A cache directory
    that others can write to is not trusted: the library is then compiled for this process
    alone."""
    compiler = _compiler()
    if compiler is None:
        raise OSError("no C++ compiler found (c++, g++, $CXX)")
    directory = _cache_dir()
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    prefix = f"bf16_rows-{variant}-{cache_key(variant, compiler)[:24]}"
    if not _private(directory):
        log.warning(
            "zoo's kernel cache %s can be written by other users: zoo compiles its bfloat16 "
            "kernel for this process alone instead of loading it from there. Make the "
            "directory private (chmod 700) or set %s to one that is.",
            directory,
            CACHE_ENV,
        )
        with tempfile.TemporaryDirectory(prefix="zoo-kernels-") as scratch:
            return ctypes.CDLL(str(_build(variant, compiler, Path(scratch), prefix)))
    for found in sorted(directory.glob(f"{prefix}.*.so")):
        if intact(found):
            return ctypes.CDLL(str(found))
        log.warning(
            "zoo's compiled kernel %s does not hash to the SHA-256 recorded in its name when it "
            "was built: it was changed since, and is compiled again, not loaded.",
            found,
        )
        found.unlink(missing_ok=True)
    return ctypes.CDLL(str(_build(variant, compiler, directory, prefix)))


def intact(library: Path) -> bool:
    """Whether `library`'s bytes hash to the SHA-256 its name carries (`<key>.<sha256>.so`), and
    it is a plain file of this process's user (or root) that no one else can write to."""
    recorded = library.name.removesuffix(".so").rpartition(".")[2]
    return (
        _private(library)
        and library.is_file()
        and hashlib.sha256(library.read_bytes()).hexdigest() == recorded
    )


def _private(path: Path) -> bool:
    """Whether `path` belongs to this process's user (or root) and no one else may write it."""
    status = path.lstat()
    return status.st_uid in (os.geteuid(), 0) and not status.st_mode & 0o022


def _build(variant: str, compiler: str, directory: Path, prefix: str) -> Path:
    """`variant` compiled into `directory` as `<prefix>.<its SHA-256>.so`, written whole or not
    at all."""
    with tempfile.TemporaryDirectory(dir=directory) as scratch:
        built = Path(scratch) / "bf16_rows.so"
        command = [compiler, *FLAGS, *VARIANTS[variant].flags, "-fPIC", "-shared", "-w"]
        command += ["-I", jax.ffi.include_dir(), str(SOURCE), "-o", str(built)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
        if done.returncode != 0:
            raise OSError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        target = directory / f"{prefix}.{hashlib.sha256(built.read_bytes()).hexdigest()}.so"
        built.chmod(0o755)
        os.replace(built, target)
    return target


def cache_key(variant: str, compiler: str) -> str:
    """What a build depends on, hashed: the source, the flags, the variant, the compiler's
    version (the first line of its `--version`) and jaxlib's version."""
    key = hashlib.sha256(SOURCE.read_bytes())
    parts = (*FLAGS, *VARIANTS[variant].flags, variant, compiler_version(compiler))
    key.update("\0".join((*parts, jaxlib.__version__)).encode())
    return key.hexdigest()


@functools.cache
def compiler_version(compiler: str) -> str:
    """The first line of `compiler --version` (e.g. `g++ (Debian 12.2.0-14) 12.2.0`)."""
    done = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0 or not done.stdout.strip():
        raise OSError(f"{compiler} --version failed: {done.stderr.strip()[-200:]}")
    return done.stdout.strip().splitlines()[0]


def _compiler() -> str | None:
    """The C++ compiler the kernel is compiled with: `$CXX`, else `c++`, else `g++`."""
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def _cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache_home) / "zoo" / "kernels"

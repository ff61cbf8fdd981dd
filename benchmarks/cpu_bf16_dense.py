"""A bfloat16 MLP's forward and backward on a CPU: XLA's bfloat16 product (widened to float32
by XLA:CPU) against `zoo.engine.kernels.cpu_dot` (its bfloat16 path, backward included), and float32.

    python -m benchmarks.cpu_bf16_dense
    python -m benchmarks.cpu_bf16_dense --decoding

The shapes are gpt `--small`'s MLP (batch 8 x 256 tokens = 2,048 rows, width 256, hidden
1,024): the gradient of two products with a GELU between, with respect to both weights. Rounds
of `--steps` calls of each in turn; medians (min-max) in ms per call over `--rounds`.

`--decoding`: the products of a decoding step instead, a kernel held outputs first by 1 and by 8
rows at Qwen3-0.6B's shapes (the MLP's up and down projections, the tied output layer): float32;
XLA's bfloat16 product; the float32 copy a session makes where zoo's bfloat16 kernel does not run
(`zoo.engine.kernels.widened`); and each variant of the kernel that the CPU runs
(`zoo.engine.kernels.bf16_rows`).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from zoo.engine.kernels import bf16_rows, cpu_dot

from benchmarks import machine

NUMBERS = (((2,), (0,)), ((), ()))


def mlp_gradient(dot: Callable) -> Callable:
    def loss(weights, x):
        w_in, w_out = weights
        hidden = jax.nn.gelu(dot(x, w_in, NUMBERS))
        return jnp.sum(dot(hidden, w_out, NUMBERS).astype(jnp.float32) ** 2)

    return jax.jit(jax.grad(loss))


def inputs(dtype, rows: int = 2048, width: int = 256, hidden: int = 1024):
    kx, k_in, k_out = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (rows // 256, 256, width))
    w_in = jax.random.normal(k_in, (width, hidden)) / np.sqrt(width)
    w_out = jax.random.normal(k_out, (hidden, width)) / np.sqrt(hidden)
    return (w_in.astype(dtype), w_out.astype(dtype)), x.astype(dtype)


DECODING_SHAPES = ((3072, 1024), (1024, 3072), (151936, 1024))
"""(outputs, inputs) of Qwen3-0.6B's products: the MLP's up (and gate) and down projections,
the tied output layer."""


def kernel_first(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """XLA's product of a few rows, the kernel first (as `zoo.engine.kernels.dense` takes it)."""
    return jax.lax.dot_general(kernel, x, (((1,), (1,)), ((), ()))).T


def decoding_products(rows: int, outputs: int, width: int) -> dict[str, tuple[Callable, tuple]]:
    """Each way to multiply `rows` bfloat16 rows by an outputs x width kernel, with its operands."""
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (rows, width)).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (outputs, width)).astype(jnp.bfloat16)
    ways = {
        "fp32": (jax.jit(kernel_first), (x.astype(jnp.float32), w.astype(jnp.float32))),
        "bf16, XLA": (jax.jit(kernel_first), (x, w)),
        "bf16, fp32 copy": (
            jax.jit(lambda x, copy: kernel_first(x.astype(jnp.float32), copy).astype(x.dtype)),
            (x, w.astype(jnp.float32)),
        ),
    }
    for variant in bf16_rows.runnable():
        if bf16_rows.load(variant):
            product = functools.partial(bf16_rows.product, variant=variant)
            ways[f"bf16, {variant}"] = (jax.jit(product), (x, w))
    return ways


def timed(loops: dict[str, tuple[Callable, tuple]], rounds: int, steps: int) -> dict[str, list]:
    """ms per call of each of `loops`, in rounds of `steps` calls of each in turn."""
    for fn, args in loops.values():
        jax.block_until_ready(fn(*args))
    times: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(rounds):
        for name, (fn, args) in loops.items():
            start = time.perf_counter()
            for _ in range(steps):
                out = fn(*args)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / steps * 1e3)
    return times


def main(argv: Sequence[str] | None = None) -> dict[str, list[float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--decoding", action="store_true", help="a decoding step's products")
    args = parser.parse_args(argv)
    print(machine.describe())
    if args.decoding:
        times = {}
        for rows in (1, 8):
            for outputs, width in DECODING_SHAPES:
                case = timed(decoding_products(rows, outputs, width), args.rounds, args.steps)
                print(f"{rows} x {width} by {outputs} x {width}:")
                report(case)
                times |= {f"{rows}x{width}x{outputs} {name}": ms for name, ms in case.items()}
        return times
    loops = {
        "bf16, widened by XLA": (mlp_gradient(jax.lax.dot_general), inputs(jnp.bfloat16)),
        "bf16, cpu_dot": (mlp_gradient(cpu_dot.dot_general), inputs(jnp.bfloat16)),
        "fp32": (mlp_gradient(jax.lax.dot_general), inputs(jnp.float32)),
    }
    times = timed(
        {name: (fn, (w, x)) for name, (fn, (w, x)) in loops.items()}, args.rounds, args.steps
    )
    report(times)
    return times


def report(times: dict[str, list[float]]) -> None:
    for name, ms in times.items():
        print(f"  {name:<22} {np.median(ms):8.2f} ms ({min(ms):.2f}-{max(ms):.2f})")


if __name__ == "__main__":
    main()

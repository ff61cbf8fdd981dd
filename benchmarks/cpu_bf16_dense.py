"""A bfloat16 MLP's forward and backward on a CPU: XLA's bfloat16 product (widened to float32
by XLA:CPU) against `zoo.engine.kernels.cpu_dot` (its bfloat16 path, backward included), and float32.

    python -m benchmarks.cpu_bf16_dense

The shapes are gpt `--small`'s MLP (batch 8 x 256 tokens = 2,048 rows, width 256, hidden
1,024): the gradient of two products with a GELU between, with respect to both weights. Rounds
of `--steps` calls of each in turn; medians (min-max) in ms per call over `--rounds`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from zoo.engine.kernels import cpu_dot

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


def main(argv: Sequence[str] | None = None) -> dict[str, list[float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    loops = {
        "bf16, widened by XLA": (mlp_gradient(jax.lax.dot_general), inputs(jnp.bfloat16)),
        "bf16, cpu_dot": (mlp_gradient(cpu_dot.dot_general), inputs(jnp.bfloat16)),
        "fp32": (mlp_gradient(jax.lax.dot_general), inputs(jnp.float32)),
    }
    for fn, (weights, x) in loops.values():
        jax.block_until_ready(fn(weights, x))
    times: dict[str, list[float]] = {name: [] for name in loops}
    for _ in range(args.rounds):
        for name, (fn, (weights, x)) in loops.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                out = fn(weights, x)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    print(machine.describe())
    for name, ms in times.items():
        print(f"{name:<22} {np.median(ms):7.1f} ms ({min(ms):.1f}-{max(ms):.1f})")
    return times


if __name__ == "__main__":
    main()

"""Bytes per device of gpt's compiled train step at depth 4, 8 and 12, with and without remat,
gradient accumulation and bf16, from XLA's memory analysis (nothing is run); and the largest
batch (doubling from 8) whose step fits a given budget per device.

    JAX_NUM_CPU_DEVICES=1 python -m benchmarks.memory --dim 128 --budget-mib 64

Prints a table, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from collections.abc import Sequence

import jax
from zoo.engine.loop.trainer import Trainer
from zoo.engine.report.memory import step_memory

import zoo

VARIANTS = {
    "fp32": (),
    "remat": ("model.remat=true",),
    "accum4": ("trainer.grad_accum_steps=4",),
    "bf16": ("trainer.precision=bf16",),
    "bf16+remat+accum4": (
        "trainer.precision=bf16",
        "model.remat=true",
        "trainer.grad_accum_steps=4",
    ),
}


def measure(depth: int, dim: int, context: int, batch: int, extra: Sequence[str]) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        overrides = [
            "model=gpt",
            f"model.depth={depth}",
            f"model.dim={dim}",
            f"model.context_length={context}",
            f"data.window={context}",
            "data.eval_bytes=4096",
            f"trainer.batch_size={batch}",
            "optimizer.warmup_steps=0",
            "mesh.data=1",
            f"workdir={workdir}",
            *extra,
        ]
        return step_memory(Trainer(zoo.compose(overrides), jax.devices()[:1]))


def largest_batch(depth, dim, context, extra, budget: int, limit: int = 1024) -> int | None:
    """The largest batch of 8 x 2^k (up to `limit`) whose step's peak fits `budget` bytes."""
    best = None
    batch = 8
    while batch <= limit and measure(depth, dim, context, batch, extra)["peak"] <= budget:
        best, batch = batch, batch * 2
    return best


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 8, 12])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--budget-mib", type=float, default=64.0)
    args = parser.parse_args(argv)
    budget = int(args.budget_mib * 2**20)
    rows = []
    for depth, (name, extra) in itertools.product(args.depths, VARIANTS.items()):
        sizes = measure(depth, args.dim, args.context, args.batch, extra)
        fits = largest_batch(depth, args.dim, args.context, extra, budget)
        rows.append({"depth": depth, "variant": name, **sizes, "largest_batch": fits})
    print(f"gpt dim {args.dim}, context {args.context}, batch {args.batch}, one device; MiB:")
    print(f"{'depth':>5} {'variant':<18} {'args':>8} {'temps':>8} {'peak':>8} largest batch")
    for row in rows:
        mib = [row[k] / 2**20 for k in ("arguments", "temporaries", "peak")]
        print(
            f"{row['depth']:>5} {row['variant']:<18} {mib[0]:>8.1f} {mib[1]:>8.1f} {mib[2]:>8.1f} "
            f"{row['largest_batch']} (budget {args.budget_mib:g} MiB)"
        )
    print(json.dumps({"platform": jax.devices()[0].platform, "rows": rows, **vars(args)}))


if __name__ == "__main__":
    main()

"""What the checkpoints' checksums cost: the seconds a save blocks the loop and a restore takes,
against the part of each that computes the checksums (`zoo.engine.checkpoints.checksums`).

    python -m benchmarks.checkpoint_integrity --repeats 5 --json runs/bench/integrity.json
    JAX_NUM_CPU_DEVICES=8 python -m benchmarks.checkpoint_integrity mesh.data=1 mesh.fsdp=8

Config overrides after the options apply to every state (the second line: params sharded over 8
devices, where each device sums its own shard). For each state (a model's train state: params,
optimizer moments, RNG streams), in turns: the checksums alone (computed on the devices,
fetched), a save's blocking part (the checksums, the copy off the devices, Orbax's bookkeeping;
the write to disk overlaps with training and is waited for separately, untimed), and a full
restore (read, place, verify). Medians over the repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
from zoo.engine.checkpoints import checksums
from zoo.engine.checkpoints.manager import Checkpointer
from zoo.engine.checkpoints.reader import abstract_like
from zoo.engine.loop.trainer import Trainer
from zoo.engine.sharding import mesh as sharding

import zoo

STATES = {
    "mlp": ["model=mlp"],
    "gpt": ["model=gpt"],
    "gpt-25M": ["model=gpt", "model.dim=512", "model.depth=8", "model.num_heads=8"],
}


def timed(fn) -> float:
    started = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - started


def measure(name: str, overrides: list[str], repeats: int, root: str) -> dict:
    trainer = Trainer(zoo.compose([*overrides, f"workdir={root}/{name}"]))
    state, params = trainer.state, trainer.param_count
    arrays = checksums.flat(state, "state")
    iterator = trainer.dispatcher.iterate(trainer.train_data)
    checkpointer = Checkpointer(f"{root}/{name}/checkpoints", keep=2)
    config = {"model": {"name": name}}
    figures: dict[str, list[float]] = {"checksums": [], "save_blocking": [], "restore": []}
    with sharding.activate(trainer.mesh, trainer.rules):
        checksums.checksums(arrays)  # compiled once, outside the timings
        for step in range(1, repeats + 2):
            figures["checksums"].append(timed(lambda: checksums.checksums(arrays)))
            figures["save_blocking"].append(
                timed(lambda step=step: checkpointer.save(step, state, iterator, config))
            )
            checkpointer.wait()  # the write, untimed
            target = abstract_like(state)
            figures["restore"].append(
                timed(lambda step=step, target=target: checkpointer.restore_state(step, target))
            )
    checkpointer.close()
    iterator.close()
    medians = {key: statistics.median(values[1:]) for key, values in figures.items()}  # warm
    size = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state) if hasattr(x, "size"))
    return {"params": params, "state_bytes": size, **medians}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--states", nargs="*", default=list(STATES))
    parser.add_argument("--json", type=Path)
    parser.add_argument("overrides", nargs="*", help="config overrides for every state")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as root:
        for name in args.states:
            results[name] = measure(name, [*STATES[name], *args.overrides], args.repeats, root)
            r = results[name]
            print(
                f"{name:8} {r['params']:>12,} params {r['state_bytes'] / 2**20:>8.1f} MiB state | "
                f"checksums {1e3 * r['checksums']:8.1f} ms | save blocks {1e3 * r['save_blocking']:8.1f} ms "
                f"| restore {1e3 * r['restore']:8.1f} ms",
                flush=True,
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        command = " ".join(
            [
                "python -m benchmarks.checkpoint_integrity",
                f"--repeats {args.repeats}",
                *args.overrides,
            ]
        )
        args.json.write_text(json.dumps({"command": command, "results": results}, indent=2))


if __name__ == "__main__":
    main()

"""Step time with and without the trainer's logging, on a model's default config.

    python -m benchmarks.logging_overhead --model mlp --windows 30 --json runs/bench/logging.json

Three loops over the same model, config and data, one step per dispatch, window after window in
turn (so that load on the machine hits them alike):

- `bare`: the run's own jitted train step over its own pipeline (batches placed on the devices
  step by step, the host at most `zoo.engine.report.observe.MAX_IN_FLIGHT` dispatches ahead); no clocks, no
  log windows, no events.
- `default`: the trainer's real loop (`Trainer.steps()`) at default settings: the data-wait
  clock around every batch, compile counting, every `trainer.log_every` steps a log window,
  fetched a window late and written as TensorBoard scalars, and every `logging.norms_every`
  steps the update norms.
- `histograms`: `default` plus param and gradient histograms once per window
  (`logging.histogram_every` = `trainer.log_every`).

Each window is `trainer.log_every` steps, timed after `block_until_ready()` on its last state;
the first windows are warm-up. The runs never reach their last step, so no eval or checkpoint
falls inside a window. Reports the median time per step and the overhead over `bare`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
from zoo.engine.loop.trainer import Trainer
from zoo.engine.report.observe import InFlight
from zoo.engine.sharding import mesh as sharding
from zoo.engine.steps import functions as steps

import zoo
from benchmarks.loops import zoo_loop

WARMUP_WINDOWS = 3
NEVER = 10**9  # trainer.steps of the benchmark's runs: they stop when the benchmark does


def trainer(model: str, workdir: str, *overrides: str) -> Trainer:
    return Trainer(
        zoo.compose(
            [
                f"model={model}",
                f"workdir={workdir}",
                f"trainer.steps={NEVER}",
                "trainer.eval_every=0",
                "trainer.steps_per_dispatch=1",
                *overrides,
            ]
        )
    )


def bare_loop(run: Trainer) -> Callable[[int], None]:
    """`advance(n)`: n steps of the run's own train step, nothing else."""
    state = jax.tree.map(lambda x: x.copy(), run.state)
    with sharding.activate(run.mesh, run.rules):
        batch = run.shard(next(iter(run.train_data)))
        zeros = steps.zero_metrics(run.train_step, state, {}, batch, run.step_key)
    iterator, holder = iter(run.train_data), [state]

    def advance(n: int) -> None:
        in_flight, sums = InFlight(), zeros
        with sharding.activate(run.mesh, run.rules):
            for _ in range(n):
                batch = run.shard(next(iterator))
                holder[0], sums = run.train_step(holder[0], sums, batch, run.step_key)
                in_flight.add(sums[steps.COUNT])
        jax.block_until_ready(holder[0])

    return advance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--windows", type=int, default=30, help="timed windows per variant")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        default = trainer(args.model, f"{tmp}/default")
        every = int(default.cfg.trainer.log_every)
        histograms = trainer(args.model, f"{tmp}/histograms", f"logging.histogram_every={every}")
        loops = {
            "bare": bare_loop(default),
            "default": zoo_loop(default),
            "histograms": zoo_loop(histograms),
        }
        seconds: dict[str, list[float]] = {name: [] for name in loops}
        for _ in range(WARMUP_WINDOWS + args.windows):
            for name, advance in loops.items():
                started = time.perf_counter()
                advance(every)
                seconds[name].append((time.perf_counter() - started) / every)
        for name in ("default", "histograms"):
            loops[name].close()  # type: ignore[attr-defined]

    medians = {name: statistics.median(s[WARMUP_WINDOWS:]) for name, s in seconds.items()}
    base = medians["bare"]
    result = {
        "command": f"python -m benchmarks.logging_overhead --model {args.model} "
        f"--windows {args.windows}",
        "model": args.model,
        "devices": jax.device_count(),
        "window_steps": every,
        "windows": args.windows,
        "median_ms_per_step": {name: 1e3 * s for name, s in medians.items()},
        "overhead_vs_bare": {name: s / base - 1 for name, s in medians.items()},
    }
    print(
        f"{args.model}, {jax.device_count()} device(s), windows of {every} steps, "
        f"median of {args.windows} windows each"
    )
    print(f"{'variant':<12} {'ms/step':>9} {'overhead':>9}")
    for name, per_step in medians.items():
        print(f"{name:<12} {1e3 * per_step:>9.4f} {100 * (per_step / base - 1):>8.2f}%")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

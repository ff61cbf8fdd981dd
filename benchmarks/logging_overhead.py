"""Step time with and without the trainer's logging, on a model's default config.

    python -m benchmarks.logging_overhead --model mlp --windows 30 --json runs/bench/logging.json

Three ways to run the same training loop, each on its own copy of the train state, window after
window in turn (so that load on the machine hits them alike):

- `bare`: the train step alone; no clocks, no log windows, no events.
- `default`: what a run does at default settings: the data-wait clock around every batch,
  compile counting, every `trainer.log_every` steps a log window, fetched a window late and
  written as TensorBoard scalars, and every `logging.norms_every` steps the update norms.
- `histograms`: `default` plus param and gradient histograms once per window
  (`logging.histogram_every` = `trainer.log_every`).

Each window is `trainer.log_every` steps, timed after `block_until_ready()` on its last state;
the first windows are warm-up. Reports the median time per step and the overhead over `bare`.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax

import zoo
from train import sharding, steps
from train.loop import MAX_STEPS_IN_FLIGHT, Trainer, _LogWindows
from train.observe import CompileWatch, Deferred, WindowClock
from train.report import Reporter

WARMUP_WINDOWS = 3


class Variant:
    """One way to run the loop, with its own state, batches, sums and logging."""

    def __init__(self, name: str, trainer: Trainer, workdir: str | None, histogram_every: int):
        self.name, self.trainer = name, trainer
        self.state = jax.tree.map(lambda x: x.copy(), trainer.state)
        self.step_fn = trainer.train_step  # the run's own jitted step, shared by all variants
        with sharding.activate(trainer.mesh, trainer.rules):
            batch = trainer.shard(next(iter(trainer.train_data)))
            self.zeros = steps.zero_metrics(self.step_fn, self.state, {}, batch, trainer.step_key)
        self.iterator = iter(trainer.train_data)
        self.step = 0
        self.seconds_per_step: list[float] = []
        self.logged = workdir is not None
        if self.logged:
            self.reporter = Reporter(workdir, 10**9, primary=True)
            self.clock = WindowClock(0, int(trainer.cfg.trainer.batch_size))
            self.compiles = CompileWatch()
            norms_every = int(trainer.cfg.logging.norms_every)
            self.probes = [
                Deferred(
                    trainer.norms_step,
                    lambda s: s % norms_every == 0,
                    lambda s, norms: self.reporter.scalars("train", s, norms),
                ),
                Deferred(
                    trainer.histogram_step,
                    lambda s: histogram_every and s % histogram_every == 0,
                    self.reporter.histograms,
                ),
            ]

            def extras(step: int) -> None:
                self.reporter.scalars("compile", step, self.compiles.totals())
                for probe in self.probes:
                    probe.write(up_to=step)

            self.windows = _LogWindows(
                self.reporter, trainer.schedule, None, self.clock, extras, 0, False
            )

    def window(self, length: int) -> None:
        """`length` steps, timed until the last one's state is ready."""
        trainer, sums = self.trainer, self.zeros
        in_flight: collections.deque = collections.deque()
        watch = self.compiles.installed() if self.logged else contextlib.nullcontext()
        with watch, sharding.activate(trainer.mesh, trainer.rules):
            started = time.perf_counter()
            for _ in range(length):
                self.step += 1
                if self.logged:
                    with self.clock.waiting_for_data():
                        batch = trainer.shard(next(self.iterator))
                    for probe in self.probes:
                        probe.before_step(self.step, self.state, batch, trainer.step_key)
                else:
                    batch = trainer.shard(next(self.iterator))
                self.state, sums = self.step_fn(self.state, sums, batch, trainer.step_key)
                in_flight.append(sums[steps.COUNT])
                if len(in_flight) > MAX_STEPS_IN_FLIGHT:
                    in_flight.popleft().block_until_ready()
            if self.logged:
                self.windows.close(self.step, sums)
            jax.block_until_ready(self.state)
            self.seconds_per_step.append((time.perf_counter() - started) / length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--windows", type=int, default=30, help="timed windows per variant")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(zoo.compose([f"model={args.model}", f"workdir={tmp}/run"]))
        every = int(trainer.cfg.trainer.log_every)
        variants = [
            Variant("bare", trainer, None, 0),
            Variant("default", trainer, f"{tmp}/default", 0),
            Variant("histograms", trainer, f"{tmp}/histograms", every),
        ]
        for _ in range(WARMUP_WINDOWS + args.windows):
            for variant in variants:
                variant.window(every)
        for variant in variants:
            if variant.logged:
                variant.reporter.close()

    medians = {v.name: statistics.median(v.seconds_per_step[WARMUP_WINDOWS:]) for v in variants}
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
    for name, seconds in medians.items():
        print(f"{name:<12} {1e3 * seconds:>9.4f} {100 * (seconds / base - 1):>8.2f}%")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

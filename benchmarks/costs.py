"""What a run costs besides its steps: start-up, compilations, checkpoints, sharding.

    python -m benchmarks.costs [--models xor,mlp,cnn,gpt] [--repeats 3] [--json PATH]
        [--only wall,startup,compiles,checkpoint,devices] [--steps N]

`benchmarks.run` times the steps of a warm loop; a user waits for more than that. Each section
runs whole commands in fresh processes (imports, data, compilation included), on one CPU device
unless it says otherwise, and reads the run's own `train.log` (see `benchmarks.cli_runs`):

- `wall`: `python -m zoo.train model=xor` against `python benchmarks/bare_xor.py`, the same
  training written by hand, run in turns (zoo, bare, zoo, bare, ...); the ratio is taken pair by
  pair. The goal: the zoo command within 2x of the bare script. Both print their final accuracy.
- `startup`: from the launch to the end of the run's set-up (data, model, optimizer), to its
  first step dispatched (compiled and running), and to the command's exit.
- `compiles`: a run with `JAX_LOG_COMPILES=1`, with an eval and a checkpoint half way, then the
  same run resumed for half as many steps again; counts each jitted function's compilations and
  distinct argument signatures (shapes and shardings), on 1 and on 8 CPU devices, with JAX's
  persistent compilation cache off whatever the environment sets (a cache hit is no
  compilation: it would hide what a first run compiles). The goal: one
  train step (`train_step`, or `train_steps` when K steps are dispatched at a time) and one
  `eval_step` per signature. The counts are deterministic: one run each.
- `checkpoint`: a run saving every quarter of its steps, then `--repeats` resumes, each
  restoring the latest checkpoint, training a quarter more and saving, on 1 and on 8 CPU
  devices: the seconds each save blocks the loop (a process's first save apart: it pays
  one-time costs), the seconds each restore takes, and the size of a checkpoint on disk.
- `devices`: steps/s of the zoo trainer's warm loop (`benchmarks.sharded_steps`) on 8 CPU
  devices against 1, the same global batch; a process per device count, in turns, once per
  repeat. On a 2-core machine the 8 simulated devices share the 2 cores: the ratio is the cost
  of sharding a step 8 ways, not a speed-up.

The runs of mlp, cnn and gpt are a few steps of their default configs (`SHORT_STEPS`; gpt with
a smaller eval set, a default warm-up longer than a quarter of the steps cut to a tenth); xor's
are its default config. `--steps` sets every run's steps, for a quick check. The environment
passes through but for `JAX_NUM_CPU_DEVICES`, which each run sets. A run that XLA:CPU aborts on
a stuck all-reduce (8 simulated devices on 2 cores, now and then) is run again, and listed under
`aborted_runs`. Every figure of several samples is a median with min and max.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

import zoo
from benchmarks import cli_runs
from benchmarks.run import spread

SECTIONS = ("wall", "startup", "compiles", "checkpoint", "devices")
SECTION_MODELS = {
    "wall": ("xor",),
    "startup": ("xor", "mlp", "cnn", "gpt"),
    "compiles": ("xor", "mlp", "cnn", "gpt"),
    "checkpoint": ("xor", "mlp", "gpt"),
    "devices": ("xor", "mlp", "cnn"),
}
"""The models each section measures, of those that `--models` names."""
SHORT_STEPS = {"mlp": 400, "cnn": 40, "gpt": 24}
"""Steps of the runs of models whose default runs are long; the others run their defaults."""
EXTRA_OVERRIDES = {"gpt": ["data.eval_bytes=32768"]}
"""A shorter eval for gpt: its default eval set takes longer than its few steps."""
DEVICE_COUNTS = (1, 8)


def short_run(model: str, steps: int | None) -> tuple[int, list[str], int]:
    """(steps, overrides, steps per dispatch) of a model's runs: its default config for `steps`
    (default: `SHORT_STEPS`), with a warm-up cut to a tenth of them where the default's is
    longer than a quarter; runs that resume it only add steps."""
    defaults = zoo.compose([f"model={model}"])
    total = steps or SHORT_STEPS.get(model, int(defaults.trainer.steps))
    extra = [f"model={model}", *EXTRA_OVERRIDES.get(model, [])]
    if defaults.optimizer.warmup_steps > total // 4:
        extra.append(f"optimizer.warmup_steps={total // 10}")
    return total, extra, int(defaults.trainer.steps_per_dispatch)


def cadence(steps: int, k: int) -> int:
    """`steps` rounded down to a multiple of the steps per dispatch `k` (at least one
    dispatch): cadences must be multiples of it."""
    return max(steps // k, 1) * k


def wall(tmp: Path, repeats: int, steps: int | None) -> dict[str, Any]:
    overrides = ["model=xor", *([f"trainer.steps={steps}"] if steps else [])]
    bare_command = [sys.executable, "benchmarks/bare_xor.py", *([str(steps)] if steps else [])]
    zoo_seconds, bare_seconds, zoo_accuracy, bare_accuracy = [], [], [], []
    for i in range(repeats):
        zoo_run, log = cli_runs.train(overrides, tmp / f"wall-{i}")
        zoo_seconds.append(zoo_run.seconds)
        zoo_accuracy.append(cli_runs.final_eval(log)["accuracy"])
        bare_run = cli_runs.run(bare_command, cli_runs.device_env(1))
        bare_seconds.append(bare_run.seconds)
        bare_accuracy.append(float(re.search(r"accuracy ([\d.]+)", bare_run.stdout)[1]))
    ratios = [z / b for z, b in zip(zoo_seconds, bare_seconds, strict=True)]
    return {
        "xor": {
            "zoo_command": " ".join(["python -m zoo.train", *overrides, "workdir=<tmp>"]),
            "bare_command": " ".join(["python", *bare_command[1:]]),
            "zoo_seconds": spread(zoo_seconds),
            "bare_seconds": spread(bare_seconds),
            "ratio": spread(ratios),
            "per_pair": [list(pair) for pair in zip(zoo_seconds, bare_seconds, strict=True)],
            "zoo_accuracy": zoo_accuracy,
            "bare_accuracy": bare_accuracy,
        }
    }


def startup(tmp: Path, models: Sequence[str], repeats: int, steps: int | None) -> dict[str, Any]:
    runs = {model: short_run(model, steps) for model in models}
    overrides = {
        model: [*extra, f"trainer.steps={total}"] for model, (total, extra, _) in runs.items()
    }
    seconds: dict[str, dict[str, list[float]]] = {
        model: {"to_setup": [], "to_first_step": [], "wall": []} for model in models
    }
    for i in range(repeats):
        for model in models:  # the models in turns, so a burst of load spreads over them
            done, log = cli_runs.train(overrides[model], tmp / f"startup-{model}-{i}")
            seconds[model]["to_setup"].append(cli_runs.setup_done(log) - done.launched)
            seconds[model]["to_first_step"].append(cli_runs.first_dispatch(log) - done.launched)
            seconds[model]["wall"].append(done.seconds)
    return {
        model: {
            "overrides": overrides[model],
            **{f"{name}_seconds": spread(values) for name, values in figures.items()},
        }
        for model, figures in seconds.items()
    }


def compiles(tmp: Path, models: Sequence[str], steps: int | None) -> dict[str, Any]:
    env = {"JAX_LOG_COMPILES": "1", "JAX_ENABLE_COMPILATION_CACHE": "false"}
    results: dict[str, Any] = {model: {} for model in models}
    for devices in DEVICE_COUNTS:
        for model in models:
            total, extra, k = short_run(model, steps)
            half = cadence(total // 2, k)
            extra += [f"trainer.eval_every={half}", f"trainer.checkpoint_every={half}"]
            workdir = tmp / f"compiles-{model}-{devices}"
            logs = {}
            for run, run_steps in (("fresh", total), ("resumed", total + half)):
                overrides = [*extra, f"trainer.steps={run_steps}"]
                _, logs[run] = cli_runs.train(overrides, workdir, devices, env)
            results[model][str(devices)] = {
                run: cli_runs.compilations(log) for run, log in logs.items()
            }
    return results


def checkpoint(tmp: Path, models: Sequence[str], repeats: int, steps: int | None) -> dict[str, Any]:
    results: dict[str, Any] = {model: {} for model in models}
    for devices in DEVICE_COUNTS:
        for model in models:
            total, extra, k = short_run(model, steps)
            every = cadence(total // 4, k)
            extra += [f"trainer.checkpoint_every={every}", "trainer.eval_every=0"]
            workdir = tmp / f"checkpoint-{model}-{devices}"
            first, later, restores = [], [], []
            for i in range(repeats + 1):  # a fresh run, then the resumes
                overrides = [*extra, f"trainer.steps={total + i * every}"]
                _, log = cli_runs.train(overrides, workdir, devices)
                saves = list(cli_runs.checkpoint_saves(log).values())
                first.append(saves[0])
                later += saves[1:]
                restores += cli_runs.restores(log).values()
            latest = max(
                int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()
            )
            results[model][str(devices)] = {
                "parameters": cli_runs.parameters(log),
                "checkpoint_bytes": cli_runs.directory_bytes(workdir / "checkpoints" / str(latest)),
                # A save's seconds are those it blocks the loop (the rest is written behind it).
                "first_save_seconds": spread(first),
                "later_save_seconds": spread(later),
                "restore_seconds": spread(restores),
                "first_saves": first,
                "later_saves": later,
                "restores": restores,
            }
    return results


def devices(
    models: Sequence[str], repeats: int, windows: int, window_seconds: float
) -> dict[str, Any]:
    rates: dict[str, dict[int, list[float]]] = {m: {n: [] for n in DEVICE_COUNTS} for m in models}
    ratios: dict[str, list[float]] = {model: [] for model in models}
    batch_sizes: dict[str, int] = {}
    for _ in range(repeats):
        for model in models:
            medians = {}
            for count in DEVICE_COUNTS:
                command = [sys.executable, "-m", "benchmarks.sharded_steps", "--model", model]
                command += ["--windows", str(windows), "--window-seconds", str(window_seconds)]
                done = cli_runs.run(command, cli_runs.device_env(count))
                result = json.loads(done.stdout.splitlines()[-1])
                rates[model][count] += result["steps_per_sec"]
                medians[count] = statistics.median(result["steps_per_sec"])
                batch_sizes[model] = result["batch_size"]
            ratios[model].append(medians[DEVICE_COUNTS[-1]] / medians[DEVICE_COUNTS[0]])
    return {
        model: {
            "batch_size": batch_sizes[model],
            "steps_per_sec": {str(n): spread(values) for n, values in rates[model].items()},
            "ratio": spread(ratios[model]),
            "per_window": {str(n): values for n, values in rates[model].items()},
        }
        for model in models
    }


def _row(label: str, figure: dict[str, float], digits: int = 2) -> str:
    values = (figure["median"], figure["min"], figure["max"])
    return f"{label:<44}" + "".join(f" {v:>9.{digits}f}" for v in values)


def _header(title: str) -> None:
    print(f"\n{title}\n{'':<44} {'median':>9} {'min':>9} {'max':>9}")


def print_wall(results: dict[str, Any]) -> None:
    _header("wall: seconds of the whole command, imports and compilation included")
    for result in results.values():
        print(f"zoo:  {result['zoo_command']}\nbare: {result['bare_command']}")
        print(_row("zoo", result["zoo_seconds"]))
        print(_row("bare", result["bare_seconds"]))
        print(_row("ratio zoo/bare, pair by pair", result["ratio"]))
        accuracy = min(result["zoo_accuracy"]), min(result["bare_accuracy"])
        print(f"final eval accuracy, lowest: zoo {accuracy[0]:.4f}, bare {accuracy[1]:.4f}")


def print_startup(results: dict[str, Any]) -> None:
    _header("startup: seconds from the launch, 1 device")
    for result in results.values():
        print(" ".join(result["overrides"]))
        for name in ("to_setup", "to_first_step", "wall"):
            print(_row(f"  {name.replace('_', ' ')}", result[f"{name}_seconds"]))


def print_compiles(results: dict[str, Any]) -> None:
    print("\ncompiles: XLA seconds; compilations per jitted function (distinct signatures)")
    for model, by_devices in results.items():
        for count, runs in by_devices.items():
            for kind, functions in runs.items():
                seconds = sum(f["seconds"] for f in functions.values())
                listed = ", ".join(
                    f"{name} {f['count']}" + (f" ({f['signatures']})" if f["count"] > 1 else "")
                    for name, f in functions.items()
                )
                print(f"{model:<5} {count} dev {kind:<7} {seconds:5.2f} s: {listed}")


def print_checkpoint(results: dict[str, Any]) -> None:
    _header("checkpoint: seconds (a save: the seconds it blocks the loop)")
    for model, by_devices in results.items():
        for count, result in by_devices.items():
            print(
                f"{model}, {count} device(s): {result['parameters']:,} parameters, "
                f"{result['checkpoint_bytes']:,} bytes on disk per checkpoint"
            )
            for name in ("first_save", "later_save", "restore"):
                label = f"  {name.replace('_', ' ')} ({len(result[name + 's'])})"
                print(_row(label, result[f"{name}_seconds"], 3))


def print_devices(results: dict[str, Any]) -> None:
    _header("devices: steps/s of the warm zoo loop, same global batch, 2 cores")
    for model, result in results.items():
        for count, figure in result["steps_per_sec"].items():
            print(_row(f"{model} batch {result['batch_size']}, {count} device(s)", figure, 1))
        print(_row(f"{model} ratio 8 devices / 1", result["ratio"]))


TABLES = {
    "wall": print_wall,
    "startup": print_startup,
    "compiles": print_compiles,
    "checkpoint": print_checkpoint,
    "devices": print_devices,
}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="xor,mlp,cnn,gpt", help="comma-separated")
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, help="every run's trainer.steps (default: a few)")
    parser.add_argument("--windows", type=int, default=5, help="devices: windows per process")
    parser.add_argument("--window-seconds", type=float, default=0.5)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    sections = [s for s in args.only.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")

    report: dict[str, Any] = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "jax": jax.__version__,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
        },
        "settings": {**vars(args), "json": str(args.json)},
        "section_seconds": {},
        "aborted_runs": cli_runs.ABORTED,  # filled in as the runs go
    }
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        runs = {
            "wall": lambda chosen: wall(tmp, args.repeats, args.steps),
            "startup": lambda chosen: startup(tmp, chosen, args.repeats, args.steps),
            "compiles": lambda chosen: compiles(tmp, chosen, args.steps),
            "checkpoint": lambda chosen: checkpoint(tmp, chosen, args.repeats, args.steps),
            "devices": lambda chosen: devices(
                chosen, args.repeats, args.windows, args.window_seconds
            ),
        }
        for section in SECTIONS:
            measured = [model for model in models if model in SECTION_MODELS[section]]
            if section not in sections or not measured:
                continue
            start = time.perf_counter()
            report[section] = runs[section](measured)
            report["section_seconds"][section] = time.perf_counter() - start
            TABLES[section](report[section])
            count = len(cli_runs.ABORTED)
            note = f"; so far {count} run(s) aborted by XLA:CPU and run again" if count else ""
            print(f"({section}: {report['section_seconds'][section]:.0f} s{note})", flush=True)
            if args.json:  # after each section: a later failure keeps the figures so far
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()

"""Wall time of whole training commands, imports and compilation included.

    python -m benchmarks.cli_wall_time --repeats 5 --json runs/bench/cli_wall_time.json

Runs `python -m zoo.train model=<model>` (its default config) in fresh processes, one after
another, and reports the median, min and max wall time, plus the eval accuracy each run reached
as read back from its TensorBoard events.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parent.parent


def one_run(model: str, workdir: Path) -> tuple[float, float]:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "zoo.train", f"model={model}", f"workdir={workdir}"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    seconds = time.perf_counter() - start
    events = EventAccumulator(str(workdir))
    events.Reload()
    return seconds, events.Scalars("eval/accuracy")[-1].value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="xor")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        runs = [one_run(args.model, Path(tmp) / str(i)) for i in range(args.repeats)]
    seconds = [s for s, _ in runs]
    result = {
        "command": f"python -m zoo.train model={args.model}",
        "repeats": args.repeats,
        "wall_seconds": {
            "median": statistics.median(seconds),
            "min": min(seconds),
            "max": max(seconds),
        },
        "eval_accuracy": [accuracy for _, accuracy in runs],
    }
    wall = result["wall_seconds"]
    print(f"{'command':<36} {'median s':>9} {'min s':>7} {'max s':>7} {'eval acc':>9}")
    print(
        f"{result['command']:<36} {wall['median']:>9.2f} {wall['min']:>7.2f} {wall['max']:>7.2f}"
        f" {min(result['eval_accuracy']):>9.3f}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

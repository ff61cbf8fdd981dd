"""Wall time of whole training commands, imports and compilation included.

    python -m benchmarks.cli_wall_time --repeats 5 --json runs/bench/cli_wall_time.json

Runs `python -m zoo.train model=<model>` (its default config) in fresh processes, one after
another, and reports the median, min and max wall time, plus the eval accuracy each run reached
as read back from its train.log.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks import cli_runs
from benchmarks.run import spread


def one_run(model: str, workdir: Path) -> tuple[float, float]:
    """(wall seconds, final eval accuracy) of the model's default command."""
    done, log = cli_runs.train([f"model={model}"], workdir)
    return done.seconds, cli_runs.final_eval(log)["accuracy"]


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
        "wall_seconds": spread(seconds),
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

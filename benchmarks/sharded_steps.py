"""Steps/s of the zoo trainer's loop on every device of this process: one side of the sharded
against single-device comparison of `benchmarks.costs`, which runs this module in processes
started with `JAX_NUM_CPU_DEVICES=1` and `=8` (the device count is fixed when JAX starts).

    JAX_NUM_CPU_DEVICES=8 python -m benchmarks.sharded_steps --model mlp --windows 5

The default mesh puts every device on the data axis, so the model's default global batch is
split over them. The loop is `benchmarks.loops.zoo_loop` on `benchmarks.run.benchmark_trainer`
(no periodic eval or checkpoint), warmed up, then timed in windows of the same number of steps
as in `benchmarks.run`, each until `block_until_ready()`. Prints one JSON line: the steps/s of
each window.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Sequence

import jax

from benchmarks import loops
from benchmarks.run import _timed, benchmark_trainer


def window_rates(model: str, windows: int, window_seconds: float) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        trainer = benchmark_trainer(model, workdir)
        advance = loops.zoo_loop(trainer)
        try:
            advance(int(trainer.cfg.trainer.log_every))  # compilation, a log window, caches
            steps = max(2, round(window_seconds * 2 / _timed(advance, 2)))
            rates = [steps / _timed(advance, steps) for _ in range(windows)]
        finally:
            advance.close()  # type: ignore[attr-defined]
    return {
        "devices": jax.device_count(),
        "mesh": dict(trainer.mesh.shape),
        "batch_size": int(trainer.cfg.trainer.batch_size),
        "steps_per_window": steps,
        "steps_per_sec": rates,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--window-seconds", type=float, default=0.5)
    args = parser.parse_args(argv)
    print(json.dumps(window_rates(args.model, args.windows, args.window_seconds)))


if __name__ == "__main__":
    main()

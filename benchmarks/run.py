"""Steps/s of the zoo trainer against a bare jitted loop, NNX's tutorial loop and PyTorch.

    python -m benchmarks.run [--models xor,mlp,cnn,...] [--windows 7] [--json runs/bench/run.json]

For each model, every loop trains the same model (same initial state, optimizer, data, batch
size) in this one process. After a warm-up, the loops run in interleaved windows of the same
number of steps (zoo, bare, nnx, torch, zoo, bare, ...), each window timed until
`block_until_ready()`; a figure is the median over the windows, with min and max, and each ratio
is computed window by window, so a burst of load on the machine hits both sides of a ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
from omegaconf import OmegaConf
from zoo.engine import registry
from zoo.engine.loop.trainer import Trainer

import zoo
from benchmarks import loops, machine
from benchmarks.torch_loops import torch_loop

LOOPS = ("zoo", "zoo_dispatch", "bare", "nnx", "torch")
RATIOS = (
    ("zoo", "bare"),
    ("zoo_dispatch", "bare"),
    ("zoo", "nnx"),
    ("zoo_dispatch", "nnx"),
    ("zoo", "torch"),
    ("zoo_dispatch", "torch"),
)


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def benchmark_trainer(
    model: str,
    workdir: str,
    overrides: Sequence[str] = (),
    devices: Sequence[Any] | None = None,
    data: registry.Splits | None = None,
) -> Trainer:
    """The zoo trainer at the model's defaults, but with no periodic eval or checkpoint (they
    are not training steps), a step budget no window reaches, so nothing ends the run, and one
    step per dispatch unless `overrides` say otherwise; on `devices` (default: all), on `data`
    in place of the registered data set (default: the config's)."""
    cfg = zoo.compose(
        [
            f"model={model}",
            f"workdir={workdir}",
            "trainer.steps=100000000",
            "trainer.eval_every=0",
            "trainer.checkpoint_every=0",
            "trainer.steps_per_dispatch=1",
            *overrides,
        ]
    )
    return Trainer(cfg, devices, data)


def _timed(advance: Callable[[int], None], steps: int) -> float:
    start = time.perf_counter()
    advance(steps)
    return time.perf_counter() - start


def compare(
    model: str,
    windows: int,
    window_seconds: float,
    steps_per_dispatch: int,
    overrides: Sequence[str] = (),
) -> dict[str, Any]:
    """The loops on one model: steps/s per loop and zoo's ratios, window by window."""
    with tempfile.TemporaryDirectory() as workdir:
        trainer = benchmark_trainer(model, f"{workdir}/zoo", overrides)
        host = loops.host_batches(trainer)
        device = loops.device_batches(trainer, host)
        cfg = OmegaConf.to_container(trainer.cfg, resolve=True, enum_to_str=True)
        entry = registry.get_model(model)
        hparams = entry.resolve(cfg["model"], registry.get_data(cfg["data"]["name"]))
        zoo_loops = {"zoo": loops.zoo_loop(trainer)}
        if steps_per_dispatch > 1:
            dispatching = benchmark_trainer(
                model,
                f"{workdir}/zoo_dispatch",
                [*overrides, f"trainer.steps_per_dispatch={steps_per_dispatch}"],
            )
            zoo_loops["zoo_dispatch"] = loops.zoo_loop(dispatching)
        advances: dict[str, Callable[[int], None]] = {
            **zoo_loops,
            "bare": loops.bare_loop(trainer, device),
            "nnx": loops.nnx_tutorial_loop(trainer, device),
        }
        torch = torch_loop(model, hparams, cfg["optimizer"], host)
        skipped = {} if callable(torch) else {"torch": torch}
        if callable(torch):
            advances["torch"] = torch
        try:
            # Warm-up: compilation, a closed log window and its TensorBoard write, caches;
            # then a short timed round sizes the windows (whole dispatches of k steps).
            k = max(steps_per_dispatch, 1)
            for advance in advances.values():
                advance(int(trainer.cfg.trainer.log_every))
            per_step = max(_timed(advance, 2 * k) / (2 * k) for advance in advances.values())
            steps = max(2 * k, round(window_seconds / per_step / k) * k)
            rates: dict[str, list[float]] = {name: [] for name in advances}
            for _ in range(windows):
                for name, advance in advances.items():
                    rates[name].append(steps / _timed(advance, steps))
            compilations = {
                "train_step": trainer.train_step._cache_size(),
                "eval_step": trainer.eval_step._cache_size(),
            }
            pipeline = loops.pipeline_rate(trainer, steps)
        finally:
            for advance in zoo_loops.values():
                advance.close()  # type: ignore[attr-defined]
        # The trainer's own account of its waiting, read back from its TensorBoard events.
        data_wait = {name: loops.data_wait_shares(f"{workdir}/{name}") for name in zoo_loops}
    result: dict[str, Any] = {
        "data": cfg["data"]["name"],
        "batch_size": cfg["trainer"]["batch_size"],
        "steps_per_window": steps,
        "steps_per_dispatch": steps_per_dispatch,
        "windows": windows,
        "steps_per_sec": {name: spread(values) for name, values in rates.items()},
        "not_measured": skipped,
        "torch_threads": getattr(torch, "threads", None),
        "compilations": compilations,
        "pipeline_batches_per_sec": pipeline,
        # How much faster the pipeline alone delivers batches than the trainer consumes them.
        "pipeline_headroom": pipeline / statistics.median(rates["zoo"]),
        # The share of each log window the loop spent waiting for its next input.
        # (None: the run was too short to close a log window after its first.)
        "data_wait_share": {
            name: spread(shares) if shares else None for name, shares in data_wait.items()
        },
        "ratios": {},
        "per_window": rates,
    }
    for a, b in RATIOS:
        if a in rates and b in rates:
            per_window = [x / y for x, y in zip(rates[a], rates[b], strict=True)]
            result["ratios"][f"{a}/{b}"] = spread(per_window)
    return result


def print_table(results: dict[str, dict[str, Any]], header: bool = True) -> None:
    if header:
        print(f"{'model':<6} {'loop or ratio':<19} {'median':>10} {'min':>10} {'max':>10}")
    for model, result in results.items():
        for name in LOOPS:
            label = name if name != "zoo_dispatch" else f"zoo K={result['steps_per_dispatch']}"
            if name in result["steps_per_sec"]:
                s = result["steps_per_sec"][name]
                row = f"{s['median']:>10.1f} {s['min']:>10.1f} {s['max']:>10.1f}"
                print(f"{model:<6} {label + ' steps/s':<19} {row}")
            elif name in result["not_measured"]:
                print(f"{model:<6} {name:<19} not measured: {result['not_measured'][name]}")
        print(
            f"{model:<6} pipeline {result['pipeline_batches_per_sec']:.0f} batches/s "
            f"({result['pipeline_headroom']:.1f}x the trainer's steps/s); data wait "
            + ", ".join(
                f"{name} {100 * share['median']:.1f}%" if share else f"{name} n/a"
                for name, share in result["data_wait_share"].items()
            )
            + f"; compilations {result['compilations']}"
        )
        for ratio, r in result["ratios"].items():
            row = f"{r['median']:>10.2f} {r['min']:>10.2f} {r['max']:>10.2f}"
            print(f"{model:<6} {ratio:<19} {row}", flush=True)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", default="xor,mlp,cnn,resnet,vit,gpt,vae", help="comma-separated model names"
    )
    parser.add_argument("--windows", type=int, default=7)
    parser.add_argument("--window-seconds", type=float, default=0.5)
    parser.add_argument(
        "--steps-per-dispatch",
        type=int,
        default=50,
        help="also time the zoo trainer with trainer.steps_per_dispatch=K (0 or 1: not)",
    )
    parser.add_argument(
        "--dispatch-models",
        default="xor,mlp,gpt,vae",
        help="the models timed with --steps-per-dispatch too (by default those without "
        "convolutions: a scan of convolutions is slow on XLA:CPU)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "overrides", nargs="*", help="config overrides for every model, e.g. data.size=512"
    )
    args = parser.parse_args(argv)
    results = {}
    print(machine.describe())
    for model in filter(None, args.models.split(",")):
        results[model] = compare(
            model,
            args.windows,
            args.window_seconds,
            args.steps_per_dispatch if model in args.dispatch_models.split(",") else 1,
            args.overrides,
        )
        print_table({model: results[model]}, header=not results.keys() - {model})
    report = {
        "machine": {
            "cpus": os.cpu_count(),
            "cpu": machine.cpu(),
            "platform": platform.platform(),
            "devices": [str(d) for d in jax.devices()],
            "jax": jax.__version__,
        },
        "models": results,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()

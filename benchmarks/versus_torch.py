"""zoo against PyTorch on this CPU, in one command: gpt's training at the CPU sizes in float32
and bfloat16 (tokens/s, `benchmarks.throughput --small`, the decoder's at the same sizes beside
it), and cnn's training (steps/s, `benchmarks.run --models cnn`), each side by side with its
PyTorch twin in one process, interleaved, medians (min-max) over rounds, zoo/PyTorch ratios
taken round by round; the CPU's model and vector features above the table.

    python -m benchmarks.versus_torch --json runs/bench/versus_torch.json

PyTorch is optional (the CPU build, in an environment of its own: see docs/performance.md);
without it the PyTorch column says why it is empty.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from benchmarks import machine, run, throughput


def rows(gpt: dict[str, Any], cnn: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per workload: zoo's and PyTorch's medians (min-max) and the ratio's."""
    table = []
    for precision in throughput.PRECISIONS:
        table.append(
            {
                "workload": f"gpt {precision} training, tokens/s",
                "zoo": gpt["loops"][f"zoo {precision}"]["tokens_per_sec"],
                "torch": gpt["loops"].get(f"torch {precision}", {}).get("tokens_per_sec"),
                "ratio": gpt["ratios"].get(f"zoo/torch {precision}"),
            }
        )
    for name, loop in gpt["loops"].items():
        if name.startswith("zoo decoder"):
            precision = name.split()[-1]
            table.append(
                {
                    "workload": f"decoder {precision} training, tokens/s",
                    "zoo": loop["tokens_per_sec"],
                    "torch": gpt["loops"]
                    .get(f"torch decoder {precision}", {})
                    .get("tokens_per_sec"),
                    "ratio": gpt["ratios"].get(f"zoo/torch decoder {precision}"),
                }
            )
    table.append(
        {
            "workload": "cnn training, steps/s",
            "zoo": cnn["steps_per_sec"]["zoo"],
            "torch": cnn["steps_per_sec"].get("torch"),
            "ratio": cnn["ratios"].get("zoo/torch"),
        }
    )
    return table


def print_table(table: list[dict[str, Any]]) -> None:
    def cell(s: dict[str, float] | None, digits: int) -> str:
        if s is None:
            return "-"
        return f"{s['median']:,.{digits}f} ({s['min']:,.{digits}f}-{s['max']:,.{digits}f})"

    print(f"{'workload':<34} {'zoo':>26} {'PyTorch':>26} {'zoo/PyTorch':>20}")
    for row in table:
        digits = 0 if "tokens" in row["workload"] else 1
        print(
            f"{row['workload']:<34} {cell(row['zoo'], digits):>26} "
            f"{cell(row['torch'], digits):>26} {cell(row['ratio'], 2):>20}"
        )


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="rounds (gpt) and windows (cnn)")
    parser.add_argument("--steps", type=int, default=5, help="gpt steps of each loop per round")
    parser.add_argument("--window-seconds", type=float, default=1.0, help="cnn's windows")
    parser.add_argument("--no-decoder", action="store_true", help="leave the decoder out")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    cpu = machine.cpu()
    print(machine.describe(cpu), flush=True)
    sizes = throughput.SMALL_SIZES
    decoder = () if args.no_decoder else ("fp32",)
    gpt = throughput.measure(sizes, args.rounds, args.steps, None, decoder)
    throughput.print_table(gpt, sizes)
    cnn = run.compare("cnn", args.rounds, args.window_seconds, 1)
    run.print_table({"cnn": cnn})
    print(machine.describe(cpu))
    table = rows(gpt, cnn)
    print_table(table)
    for why in {**gpt["not_measured"], **cnn["not_measured"]}.values():
        print(f"PyTorch not measured: {why}")
    report = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "gpt_sizes": sizes,
        "rounds": args.rounds,
        "table": table,
        "gpt": gpt,
        "cnn": cnn,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()

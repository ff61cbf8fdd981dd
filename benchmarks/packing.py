"""Packed rows against padded batches: the real tokens a fine-tune trains per second on
conversations of skewed lengths.

    python -m benchmarks.packing --json runs/bench/packing.json

A small decoder (`model=decoder`, width 256, 4 layers, 4 heads, from scratch, float32) trained
by zoo's trainer on `--conversations` conversations (`data=chat`, Qwen 2.5's chat template and
the tiny tokenizer of the `qwen25-chat` test fixture) whose user turns are Pareto-distributed in
length (shape 1.2: most a few dozen tokens, a few hundreds; with the template's system prompt
each conversation is 94 to 638 tokens, 134 the median), with `data.buckets=[64,128,256,512,1024]`:
- `padded`: one conversation a row, each batch padded to the smallest bucket that holds its
  longest (`data=chat` as it is);
- `packed`: `data.packing=true`, the conversations packed first-fit decreasing into rows of
  1024 (rows of 512 leave gaps too short for the shortest conversation: 94% non-pad tokens).
Each for `--steps` steps of `--batch` rows on one device; the time of the steps after the first
log window (compilation, one per bucket, falls in it; a later first bucket compiles later,
which the padded run pays inside the timing, as a fine-tune does). The real tokens of a step
(targets that are not padding) and the share of non-pad tokens are counted on the batches the
pipeline makes for those steps. Goals: packed at least 1.5x the padded real tokens per second,
at least 95% non-pad tokens.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT = ROOT / "tests" / "fixtures" / "pretrained" / "qwen25-chat"
MODEL = ("model.dim=256", "model.depth=4", "model.num_heads=4", "model.context_length=1024")
BUCKETS = "data.buckets=[64,128,256,512,1024]"
MODES = {"padded": (), "packed": ("data.packing=true",)}


def conversations(count: int, path: Path) -> Path:
    """`count` conversations whose user turns are Pareto-distributed in length, as JSON Lines."""
    words = np.minimum(np.random.default_rng(0).pareto(1.2, count) * 15, 180).astype(int)
    rows = [
        [
            {"role": "user", "content": f"Question {i}:" + " word" * n},
            {"role": "assistant", "content": f"Answer {i}."},
        ]
        for i, n in enumerate(words)
    ]
    path.write_text("".join(json.dumps({"messages": row}) + "\n" for row in rows))
    return path


def overrides(mode: str, data: Path, steps: int, batch: int, log_every: int) -> list[str]:
    return [
        *MODEL,
        "data=chat",
        f"data.path={data}",
        f"data.tokenizer={CHECKPOINT}",
        BUCKETS,
        *MODES[mode],
        f"trainer.steps={steps}",
        f"trainer.batch_size={batch}",
        f"trainer.log_every={log_every}",
        "trainer.eval_every=0",
        "trainer.checkpoint_every=0",
        "logging.norms_every=0",
    ]


class WindowTimes:
    """When each log window ended."""

    def __init__(self):
        self.times: dict[int, float] = {}

    def on_train_window(self, step: int, metrics: dict) -> None:
        self.times[step] = time.perf_counter()


def real_tokens(args: list[str], first: int, last: int) -> tuple[float, float]:
    """(real targets per step, non-pad share) of training batches first .. last - 1."""
    from omegaconf import OmegaConf
    from zoo.engine import registry
    from zoo.engine.pipeline.batches import train_batches

    import zoo

    config = zoo.compose(["model=decoder", *args])
    splits = registry.get_data("chat").splits(OmegaConf.to_container(config.data))
    batches = train_batches(
        splits.train, config.trainer.batch_size, config.seed, transform=splits.transform
    )
    iterator = iter(batches)
    real = shown = 0
    for step in range(last):
        batch = next(iterator)
        if step >= first:
            real += int(batch["length"].sum())
            shown += batch["tokens"].shape[0] * (batch["tokens"].shape[1] - 1)
    return real / (last - first), real / shown


def measure(mode: str, data: Path, steps: int, batch: int, log_every: int) -> dict[str, float]:
    import zoo

    args = overrides(mode, data, steps, batch, log_every)
    times = WindowTimes()
    with tempfile.TemporaryDirectory() as workdir:
        zoo.fit("decoder", *args, f"workdir={workdir}", callbacks=[times])
    first, last = min(times.times), max(times.times)
    seconds_per_step = (times.times[last] - times.times[first]) / (last - first)
    per_step, share = real_tokens(args, first, last)
    return {
        "seconds_per_step": seconds_per_step,
        "real_tokens_per_step": per_step,
        "real_tokens_per_second": per_step / seconds_per_step,
        "non_pad_share": share,
    }


def table(results: dict) -> str:
    heading = (
        f"Small decoder ({', '.join(MODEL)}), {results['conversations']} conversations of "
        f"skewed lengths, batches of {results['batch']} rows, {BUCKETS}:"
    )
    lines = [
        heading,
        "",
        "| batches | real tokens / step | non-pad share | s / step | real tokens / s | x padded |",
        "|---|---|---|---|---|---|",
    ]
    padded = results["modes"]["padded"]["real_tokens_per_second"]
    for mode, m in results["modes"].items():
        lines.append(
            f"| {mode} | {m['real_tokens_per_step']:,.0f} | {m['non_pad_share']:.1%} | "
            f"{m['seconds_per_step']:.3f} | {m['real_tokens_per_second']:,.0f} | "
            f"{m['real_tokens_per_second'] / padded:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    print(
        f"python -m benchmarks.packing --conversations {args.conversations} --steps {args.steps} "
        f"--batch {args.batch}"
    )
    results: dict = {"conversations": args.conversations, "batch": args.batch, "modes": {}}
    with tempfile.TemporaryDirectory() as directory:
        data = conversations(args.conversations, Path(directory) / "chat.jsonl")
        for mode in MODES:
            results["modes"][mode] = measure(mode, data, args.steps, args.batch, args.log_every)
    print(table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""QLoRA against LoRA: the base weights' memory on Qwen3-0.6B's architecture, and the loss a
short fine-tune reaches on a small decoder.

    python -m benchmarks.qlora --json runs/bench/qlora.json

- memory: the random bfloat16 checkpoint of Qwen3-0.6B's architecture that
  `benchmarks.decoder_costs` makes (cached), fine-tuned by zoo's trainer with LoRA of rank 16
  on every attention and MLP projection (`finetune.lora_layers=layers`), the model held in
  bfloat16; its base kernels as they are, or quantized (`finetune.quantize=int8|int4|nf4`).
  Each case in a fresh interpreter, one device: the trainer's model built (adapters, and codes
  quantized from the random initialisation) and filled from the checkpoint (each kernel
  quantized as it arrives), as a fine-tune starts; the bytes of the adapted layers' base
  weights as the model holds them (kernels; or codes and scales), of the whole model (params,
  codes and scales), the process's peak memory (`VmHWM`) less that of an interpreter that
  imported the same and did nothing, and the seconds of the build and of the fill. Goal: nf4's
  base weights at most 0.3x bfloat16's.
- loss: a small decoder (`model=decoder`, width 256, 4 layers, bytes, params in bfloat16)
  trained from scratch on the standard library's sources for `--base-steps` steps, then
  fine-tuned from that run for `--steps` steps, with LoRA of rank 16 over its kernels as they are and
  over their int8, int4 and nf4 codes; the train loss of the last window and the eval loss.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.decoder_costs import make_checkpoint, text_file
from benchmarks.pretrained_loading import CACHE, peak_resident_bytes

FORMATS = ("bf16", "int8", "int4", "nf4")
"""`bf16`: LoRA over the base kernels as they are; the others: `finetune.quantize`."""
BF16 = ("model.param_dtype=bf16",)
LORA = ("finetune.lora_rank=16", "finetune.lora_layers=layers")
TOKENS = 256
SMALL = ("model=decoder", "model.dim=256", "model.depth=4", "model.num_heads=4")
SMALL_DATA = ("data=text", "data.window=128", "data.eval_bytes=65536", "trainer.batch_size=16")


def quantize_args(fmt: str) -> tuple[str, ...]:
    return () if fmt == "bf16" else (f"finetune.quantize={fmt}",)


def measure(fmt: str, directory: str) -> dict[str, float]:
    """In this (fresh) interpreter: the fill and one step of the fine-tune in format `fmt`
    (`baseline`: nothing), the bytes it holds and the process's peak."""
    import jax

    jax.devices()
    if fmt == "baseline":
        import zoo  # the imports' memory is the baseline's too

        return {"peak_bytes": peak_resident_bytes()}
    from flax import nnx
    from zoo.engine.loop.trainer import Trainer
    from zoo.engine.sharding import mesh as sharding
    from zoo.engine.weights import pretrained as weights
    from zoo.engine.weights.quantize import QuantizedKernel

    import zoo

    with tempfile.TemporaryDirectory() as workdir:
        overrides = [
            f"finetune.init_from={directory}",
            "data=text",
            f"data.path={text_file(Path(directory))}",
            f"data.window={TOKENS}",
            "trainer.batch_size=1",
            *BF16,
            *LORA,
            *quantize_args(fmt),
            f"workdir={workdir}",
        ]
        started = time.perf_counter()
        trainer = Trainer(zoo.compose(overrides), jax.devices()[:1])
        built = time.perf_counter()
        model, _ = nnx.merge(trainer.graphdef, trainer.state)
        with sharding.activate(trainer.mesh, trainer.rules):  # as a fine-tune's start fills
            weights.fill(model, weights.open_pretrained(directory), hparams=trainer.hparams)
        jax.block_until_ready(nnx.state(model))
        filled = time.perf_counter()
    held = nnx.state(model, nnx.Any(nnx.Param, QuantizedKernel))
    base = whole = 0
    for path, variable in nnx.to_flat_state(held):
        size = variable[...].nbytes
        whole += size
        if isinstance(variable, QuantizedKernel) or (
            "base_module" in path and path[-1] == "kernel"
        ):
            base += size
    return {
        "base_bytes": base,
        "model_bytes": whole,
        "peak_bytes": peak_resident_bytes(),
        "build_seconds": built - started,
        "fill_seconds": filled - built,
    }


def in_fresh_process(fmt: str, directory: Path) -> dict[str, float]:
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "1", "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "benchmarks.qlora", "--measure", fmt, "--dir", str(directory)]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def memory(directory: Path) -> dict[str, dict[str, float]]:
    baseline = in_fresh_process("baseline", directory)["peak_bytes"]
    results = {}
    for fmt in FORMATS:
        measured = in_fresh_process(fmt, directory)
        results[fmt] = {**measured, "peak_bytes": measured["peak_bytes"] - baseline}
    for fmt in FORMATS:
        results[fmt]["base_x_bf16"] = results[fmt]["base_bytes"] / results["bf16"]["base_bytes"]
    return results


class LastWindow:
    """The train loss of a run's last log window."""

    loss = float("nan")

    def on_train_window(self, step: int, metrics: dict) -> None:
        self.loss = float(metrics["loss"])


def losses(base_steps: int, steps: int, workdir: Path) -> dict[str, dict[str, float]]:
    """The small decoder's base run, then each format's fine-tune of it."""
    import zoo

    common = ("trainer.eval_every=0", "trainer.log_every=10", "optimizer.warmup_steps=0")
    zoo.finetune(
        "decoder",
        *SMALL,
        *SMALL_DATA,
        *common,
        *BF16,  # as the fine-tunes hold it: a checkpoint is restored in the dtype it was saved in
        f"trainer.steps={base_steps}",
        f"workdir={workdir / 'base'}",
    )
    results = {}
    for fmt in FORMATS:
        last = LastWindow()
        result = zoo.finetune(
            workdir / "base",
            *SMALL_DATA,
            *common,
            *BF16,
            f"trainer.steps={steps}",
            "optimizer.learning_rate=1e-3",
            f"workdir={workdir / fmt}",
            lora_rank=16,
            lora_layers="layers",
            quantize=None if fmt == "bf16" else fmt,
            callbacks=[last],
        )
        results[fmt] = {
            "train_loss": last.loss,
            "eval_loss": float(result.eval_metrics["loss"]),
        }
    return results


def table(results: dict) -> str:
    mib = 2**20
    lines = [
        "Base weights of the adapted layers, Qwen3-0.6B's architecture (LoRA rank 16), filled:",
        "",
        "| base | base weights | x bf16 | whole model | process peak | build, fill |",
        "|---|---|---|---|---|---|",
    ]
    for fmt, m in results["memory"].items():
        lines.append(
            f"| {fmt} | {m['base_bytes'] / mib:,.0f} MiB | {m['base_x_bf16']:.3f} | "
            f"{m['model_bytes'] / mib:,.0f} MiB | {m['peak_bytes'] / mib:,.0f} MiB | "
            f"{m['build_seconds']:.0f} s, {m['fill_seconds']:.0f} s |"
        )
    steps, base_steps = results["steps"], results["base_steps"]
    lines += [
        "",
        f"Small decoder ({', '.join(SMALL[1:])}), {base_steps} steps from scratch, then {steps}",
        "steps of LoRA rank 16 in bfloat16:",
        "",
        "| base | train loss | eval loss |",
        "|---|---|---|",
    ]
    for fmt, m in results["loss"].items():
        lines.append(f"| {fmt} | {m['train_loss']:.4f} | {m['eval_loss']:.4f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=CACHE, help="where the checkpoint is kept")
    parser.add_argument("--base-steps", type=int, default=100)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--measure", choices=["baseline", *FORMATS], help=argparse.SUPPRESS)
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.dir)))
        return
    print(f"python -m benchmarks.qlora --base-steps {args.base_steps} --steps {args.steps}")
    directory = make_checkpoint(args.cache / "qwen3-0.6b-random")
    results: dict = {"memory": memory(directory), "steps": args.steps}
    results["base_steps"] = args.base_steps
    with tempfile.TemporaryDirectory() as workdir:
        results["loss"] = losses(args.base_steps, args.steps, Path(workdir))
    print(table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

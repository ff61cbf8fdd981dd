"""Training throughput of gpt: tokens/s and model FLOPs utilisation (MFU) of zoo's trainer in
fp32 and bf16, against the same model in PyTorch (`torch.compile`) on the same device.

    python -m benchmarks.throughput --json runs/bench/throughput.json          # a GPU
    python -m benchmarks.throughput --small --json runs/bench/throughput.json  # a CPU

Sizes: by default GPT-2 small (12 layers, width 768, 12 heads, context 1024, GPT-2's vocabulary
of 50,257 tokens, batch 16); `--small`: 4 layers, width 256, 4 heads, context 256, the byte
vocabulary (256), batch 8. Any size can be set on its own. `--decoder`: the decoder's training
at the same sizes joins the rounds, beside its PyTorch twin (`benchmarks.torch_decoder`). The table is printed under the CPU's model and
vector features (`benchmarks.machine`).

zoo's side is the trainer's real loop (`benchmarks.loops.zoo_loop`: the run that
`model=gpt trainer.precision=...` composes, built on one device, its pipeline, train step, metric
sums and log windows), attention through `jax.nn.dot_product_attention` in the shared transformer
block. PyTorch's side is `benchmarks.torch_gpt`: the same model, batch and AdamW, compiled, with
`F.scaled_dot_product_attention`, its batches placed on the device up front. PyTorch is optional;
without it the table says so and zoo's side is measured alone. After a warm-up (compilation),
rounds of `--steps` steps of every loop in turn are each timed until the device has finished;
figures are medians (min-max) over `--rounds` rounds, zoo/PyTorch ratios taken round by round.

Model FLOPs per token, the standard count (PaLM's appendix B; nanoGPT's MFU):
`6 N + 12 L T d`, N the params less the position embeddings (the tied embedding counted once, its
padded rows included: it is the logits' matmul), L layers, T the context, d the width. 6 N is
the forward and backward matmuls against the weights, 12 L T d the attention's scores and their
mix with the values over the full T x T square (the causal half is not discounted). Recomputed or
wasted work (remat, the padded vocabulary's masked logits) does not count. MFU = tokens/s x FLOPs
per token / peak FLOP/s, the peak being `--peak-tflops` (default: 989, an H100 SXM's dense bf16)
for both precisions. On a CPU, which has no such datasheet figure, the peak is by default
measured: the float32 FLOP/s of the fastest of a few XLA matmuls (2048 x 2048) timed in each
round beside the loops (the same peak for bf16: zoo's bf16 dense products reach up to about 3x
it on a CPU with AVX-512 BF16, docs/performance.md); the table says which peak it used.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from omegaconf import OmegaConf
from zoo.engine.loop.trainer import Trainer

from benchmarks import loops, machine
from benchmarks.run import benchmark_trainer, spread

GPU_SIZES = {"depth": 12, "dim": 768, "heads": 12, "context": 1024, "vocab": 50257, "batch": 16}
SMALL_SIZES = {"depth": 4, "dim": 256, "heads": 4, "context": 256, "vocab": 256, "batch": 8}
H100_BF16_TFLOPS = 989.0
PRECISIONS = ("fp32", "bf16")


def flops_per_token(trainer: Trainer) -> float:
    """`6 N + 12 L T d` (see the module docstring) for the trainer's gpt."""
    h = trainer.hparams
    positions = h["context_length"] * h["dim"]
    params = trainer.param_count - positions
    return 6 * params + 12 * h["depth"] * h["context_length"] * h["dim"]


def matmul_flops(size: int = 2048, repeats: int = 3) -> float:
    """FLOP/s of the fastest of `repeats` float32 matmuls of two `size` x `size` matrices on
    the default device: a CPU's practical peak."""
    a, b = jax.random.normal(jax.random.key(0), (2, size, size), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    matmul(a, b).block_until_ready()
    best = min(_timed(matmul, a, b) for _ in range(repeats))
    return 2 * size**3 / best


def _timed(work: Callable[..., Any], *args: Any) -> float:
    start = time.perf_counter()
    jax.block_until_ready(work(*args))
    return time.perf_counter() - start


def zoo_trainers(
    sizes: dict[str, int], workdir: str, model: str = "gpt", precisions: Sequence[str] = PRECISIONS
) -> dict[str, Trainer]:
    """One trainer of `model` (gpt, or the decoder, whose sizes have the same names) per
    precision, on the first device, at `sizes`."""
    overrides = [
        f"model.depth={sizes['depth']}",
        f"model.dim={sizes['dim']}",
        f"model.num_heads={sizes['heads']}",
        f"model.context_length={sizes['context']}",
        f"model.vocab_size={sizes['vocab']}",
        f"data.window={sizes['context']}",
        f"trainer.batch_size={sizes['batch']}",
    ]
    return {
        precision: benchmark_trainer(
            model,
            f"{workdir}/{model}-{precision}",
            [*overrides, f"trainer.precision={precision}"],
            jax.devices()[:1],
        )
        for precision in precisions
    }


def torch_side(
    trainer: Trainer, model: str = "gpt", precisions: Sequence[str] = PRECISIONS
) -> dict[str, Callable[[int], None]] | str:
    """PyTorch's loops of `model`'s twin (gpt's, `benchmarks.torch_gpt`, or the decoder's,
    `benchmarks.torch_decoder`), one per precision, on the trainer's first batches and device,
    or why there are none."""
    try:
        from benchmarks.torch_gpt import GPTLoss, compiled_loop
    except ImportError:
        return "PyTorch is not installed (pip install torch); zoo was measured alone"
    import torch

    device = "cuda" if jax.devices()[0].platform == "gpu" else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        return "this PyTorch build has no CUDA; zoo was measured alone"
    if model == "decoder":
        from benchmarks.torch_decoder import DecoderLoss as twin
    else:
        twin = GPTLoss
    tokens = [batch["tokens"] for batch in loops.host_batches(trainer)]
    optimizer = OmegaConf.to_container(trainer.cfg.optimizer, resolve=True, enum_to_str=True)
    return {
        precision: compiled_loop(
            lambda: twin(trainer.hparams), optimizer, tokens, precision, device
        )
        for precision in precisions
    }


def measure(
    sizes: dict[str, int],
    rounds: int,
    steps: int,
    peak: float | None,
    decoder_precisions: Sequence[str] = (),
) -> dict[str, Any]:
    """Interleaved rounds of every loop (and, without a given `peak`, of the matmul that
    measures it); tokens/s, FLOP/s and MFU per loop, medians over the rounds. The decoder's
    training at the same sizes in `decoder_precisions` joins the rounds, beside its PyTorch twin
    (its FLOPs are not gpt's, so its FLOP/s and MFU are left out)."""
    with tempfile.TemporaryDirectory() as workdir:
        trainers = zoo_trainers(sizes, workdir)
        decoders = zoo_trainers(sizes, workdir, "decoder", decoder_precisions)
        advances = {f"zoo {p}": loops.zoo_loop(t) for p, t in trainers.items()}
        advances |= {f"zoo decoder {p}": loops.zoo_loop(t) for p, t in decoders.items()}
        zoo_names = list(advances)
        torch = torch_side(trainers["fp32"])
        if not isinstance(torch, str):
            advances |= {f"torch {p}": loop for p, loop in torch.items()}
            if decoders:
                twin = torch_side(next(iter(decoders.values())), "decoder", list(decoders))
                advances |= {f"torch decoder {p}": loop for p, loop in twin.items()}
        try:
            for advance in advances.values():
                advance(2)  # compilation
            seconds: dict[str, list[float]] = {name: [] for name in advances}
            peaks = []
            for _ in range(rounds):
                for name, advance in advances.items():
                    seconds[name].append(_timed(advance, steps))
                peaks.append(peak or matmul_flops())
        finally:
            for name in zoo_names:
                advances[name].close()  # type: ignore[attr-defined]
        compilations = {
            name: t.train_step._cache_size()
            for name, t in [*trainers.items(), *(("decoder " + p, t) for p, t in decoders.items())]
        }
    per_token = flops_per_token(trainers["fp32"])
    tokens = steps * sizes["batch"] * sizes["context"]
    return {
        "flops_per_token": per_token,
        "peak_flops": spread(peaks),
        "peak_source": "--peak-tflops" if peak else "measured float32 matmul",
        "loops": {
            name: figures(times, tokens, 0.0 if "decoder" in name else per_token, peaks)
            for name, times in seconds.items()
        },
        "ratios": {
            f"zoo/torch{name}": spread(
                [t / z for z, t in zip(seconds[f"zoo{name}"], seconds[f"torch{name}"], strict=True)]
            )
            for name in [f" {p}" for p in PRECISIONS]
            + [f" decoder {p}" for p in decoder_precisions]
            if f"torch{name}" in seconds
        },
        "not_measured": {} if not isinstance(torch, str) else {"torch": torch},
        "compilations": compilations,
    }


def figures(
    seconds: list[float], tokens: int, per_token: float, peaks: list[float]
) -> dict[str, Any]:
    """A loop's tokens/s, model FLOP/s and MFU (against each round's peak) from the seconds
    its rounds of `tokens` tokens took."""
    rates = [tokens / s for s in seconds]
    return {
        "tokens_per_sec": spread(rates),
        "flops_per_sec": spread([r * per_token for r in rates]),
        "mfu": spread([r * per_token / p for r, p in zip(rates, peaks, strict=True)]),
        "per_round_seconds": seconds,
    }


def print_table(result: dict[str, Any], sizes: dict[str, int]) -> None:
    peak = result["peak_flops"]["median"]
    print(
        f"gpt {sizes['depth']} layers, width {sizes['dim']}, {sizes['heads']} heads, context "
        f"{sizes['context']}, vocabulary {sizes['vocab']}, batch {sizes['batch']}; "
        f"{result['flops_per_token'] / 1e6:.1f} MFLOP per token; peak {peak / 1e9:,.1f} GFLOP/s "
        f"({result['peak_source']}); medians (min-max) over rounds"
    )
    print(f"{'loop':<26} {'tokens/s':>28} {'GFLOP/s':>10} {'MFU':>7}")
    for name, row in result["loops"].items():
        t = row["tokens_per_sec"]
        span = f"{t['median']:,.0f} ({t['min']:,.0f}-{t['max']:,.0f})"
        gflops = row["flops_per_sec"]["median"] / 1e9
        mfu = f"{100 * row['mfu']['median']:>6.1f}%"
        flops = f"{gflops:>10,.1f} {mfu}" if gflops else f"{'-':>10} {'-':>7}"
        print(f"{name:<26} {span:>28} {flops}")
    for name, r in result["ratios"].items():
        print(f"{name:<26} {r['median']:>11.2f} ({r['min']:.2f}-{r['max']:.2f}) tokens/s ratio")
    for name, why in result["not_measured"].items():
        print(f"{name}: not measured: {why}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="the CPU sizes (see above)")
    for name in GPU_SIZES:
        parser.add_argument(f"--{name}", type=int, help="overrides the preset's")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10, help="steps of each loop per round")
    parser.add_argument(
        "--peak-tflops",
        type=float,
        help=f"the device's peak (default: {H100_BF16_TFLOPS:g} on a GPU, measured on a CPU)",
    )
    parser.add_argument(
        "--decoder",
        action="store_true",
        help="also time the decoder's training (fp32, bf16) at the same sizes, and its PyTorch twin's",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    # Two frameworks share the device: JAX takes memory as it needs it, not 75% up front.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    preset = SMALL_SIZES if args.small else GPU_SIZES
    sizes = {name: getattr(args, name) or preset[name] for name in preset}
    device = jax.devices()[0]
    peak_tflops = args.peak_tflops or (H100_BF16_TFLOPS if device.platform == "gpu" else None)
    result = measure(
        sizes,
        args.rounds,
        args.steps,
        peak_tflops and peak_tflops * 1e12,
        PRECISIONS if args.decoder else (),
    )
    cpu = machine.cpu()
    print(machine.describe(cpu))
    print_table(result, sizes)
    report = {
        "device": str(getattr(device, "device_kind", device)),
        "platform": device.platform,
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "jax": jax.__version__,
        "sizes": sizes,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        **result,
    }
    line = json.dumps(report)
    print(line)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(line + "\n")
    return report


if __name__ == "__main__":
    main()

"""Generation speed: prefill and decode tokens/s of zoo's engine (`zoo.models.sampling_loop`)
against transformers with PyTorch, in one process, on the same CPU and thread count, rounds
interleaved.

    python -m benchmarks.decode --json runs/bench/decode.json

It needs an environment with both zoo and torch + transformers (`pip install torch
transformers`; zoo's own test install has neither). The models, random weights made here (no
download), each read by both sides from the same files:
- `qwen3-0.6b`: Qwen3-0.6B's architecture (`benchmarks.decoder_costs` makes the checkpoint:
  28 layers, width 1,024, 16 query and 8 key/value heads of 128, vocabulary 151,936), in
  float32 and in bfloat16, batches of 1 and 8;
- `gpt2-small`: GPT-2 small's (12 layers, width 768, vocabulary 50,257), float32, batch 1.

Each case: prompts of `--prompt` random token ids (the same length, so that neither side pads),
`--new` tokens chosen greedily. Prefill tokens/s: the prompts' tokens over the time to the first
new token; decode tokens/s: the remaining new tokens over the time after it. zoo: a `Session`
(compiled on a warm-up call first); transformers: `model.generate` (eager PyTorch, its static
key/value cache off, as its default), warmed up the same way. `torch.set_num_threads` is set to
the cores XLA uses (all of this process's; `--single-thread`: one each). Medians of `--repeats`
rounds.

`--as-cpu avx512f`: both sides as on an x86-64 CPU with AVX-512 F but without AVX-512 BF16 or
AMX (Intel Skylake-SP, Cascade Lake, Ice Lake), run on a CPU that has them: zoo's kernel forced
to its `avx512f` variant (`ZOO_NATIVE_KERNELS`), and PyTorch's oneDNN, which multiplies its
bfloat16 products, held to that CPU's instructions (`ONEDNN_MAX_CPU_ISA=AVX512_CORE`: bfloat16
widened in software, as there).

`--kernels`: zoo alone (no torch needed), Qwen3-0.6B's architecture at batch 1 and 8 in float32
and in bfloat16 on each variant of zoo's bfloat16 CPU kernel that the CPU runs
(`zoo.engine.kernels.bf16_rows`) and on the float32 copies a session takes where none runs
(`zoo.engine.kernels.widened`), each forced in turn, rounds interleaved in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.decoder_costs import make_checkpoint
from benchmarks.pretrained_loading import CACHE

AS_CPU = {"avx512f": {"ZOO_NATIVE_KERNELS": "avx512f", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}}
"""`--as-cpu`: the environment each side reads as it starts (set before either is imported)."""
GPT2_SMALL = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
CASES = (  # (model, dtype, batch)
    ("gpt2-small", "fp32", 1),
    ("qwen3-0.6b", "fp32", 1),
    ("qwen3-0.6b", "fp32", 8),
    ("qwen3-0.6b", "bf16", 1),
    ("qwen3-0.6b", "bf16", 8),
)
CONTEXT = 512
"""zoo's context for the Qwen3 checkpoint (its own is 40,960): what a session's cache may use."""


def gpt2_checkpoint(directory: Path) -> Path:
    """A random GPT-2-small-sized checkpoint, written once by transformers."""
    if (directory / "model.safetensors").is_file():
        return directory
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(**GPT2_SMALL)).save_pretrained(directory)
    return directory


Timed = Callable[[np.ndarray, int], tuple[float, float]]
"""(prompts, new tokens) -> (seconds to the first new token, seconds of the rest)."""


def zoo_side(directory: Path, dtype: str, batch: int) -> Timed:
    import jax

    import zoo

    model = {"context_length": CONTEXT} if "qwen" in directory.name else {}
    if dtype == "bf16":
        model["param_dtype"] = "bf16"
    loaded = zoo.load(directory, model=model or None, devices=jax.devices()[:1])
    return session_timer(loaded.model, loaded.activate, batch)


def session_timer(model: Any, activate: Callable[[], Any], batch: int, loop: Any = None) -> Timed:
    """zoo's side on `model`: a `Session` of `batch` rows and `CONTEXT` slots, made and run
    inside `activate()` (the model's mesh), greedy; from `loop` (a copy of
    `zoo.models.sampling_loop`), else zoo's own."""
    from zoo.models import sampling_loop

    Session, Sampling = (loop or sampling_loop).Session, sampling_loop.Sampling
    with activate():
        session = Session(model, batch, CONTEXT)

    def run(prompts: np.ndarray, new: int) -> tuple[float, float]:
        with activate():
            start = time.perf_counter()
            steps = session.stream(list(prompts), new, Sampling(temperature=0))
            next(steps)
            first = time.perf_counter()
            for _ in steps:
                pass
            return first - start, time.perf_counter() - first

    return run


def torch_side(directory: Path, dtype: str) -> Timed:
    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch_dtype).eval()

    class FirstToken(StoppingCriteria):
        """Notes when the first new token is there (called after each step)."""

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def run(prompts: np.ndarray, new: int) -> tuple[float, float]:
        ids = torch.from_numpy(prompts).long()
        mark = FirstToken()
        mark.times = []
        with torch.inference_mode():
            start = time.perf_counter()
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                eos_token_id=None,
                pad_token_id=0,
                stopping_criteria=[mark],
            )
            end = time.perf_counter()
        return mark.times[0] - start, end - mark.times[0]

    return run


def measure(directory: Path, dtype: str, batch: int, prompt: int, new: int, repeats: int) -> dict:
    """Both sides on the same prompts, interleaved round after round; medians."""
    prompts = np.random.default_rng(0).integers(1, 1000, (batch, prompt)).astype(np.int32)
    sides = {"zoo": zoo_side(directory, dtype, batch), "transformers": torch_side(directory, dtype)}
    for run in sides.values():
        run(prompts, 4)  # compiled, warm
    times: dict[str, list] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, run in sides.items():
            times[name].append(run(prompts, new))
    result = {name: rates(pairs, batch, prompt, new) for name, pairs in times.items()}
    zoo_rate, torch_rate = (result[n]["decode_tokens_per_s"] for n in ("zoo", "transformers"))
    result["decode_x_transformers"] = zoo_rate / torch_rate
    return result


def kernel_variants(directory: Path, batch: int, prompt: int, new: int, repeats: int) -> dict:
    """zoo's decoding in float32 and in bfloat16 on each of its kernel's variants that the CPU
    runs and on the float32 copies, each forced in turn; rounds interleaved, medians."""
    from unittest import mock

    import jax
    from zoo.engine.kernels import bf16_rows

    import zoo

    prompts = np.random.default_rng(0).integers(1, 1000, (batch, prompt)).astype(np.int32)
    sides = {"fp32": zoo_side(directory, "fp32", batch)}
    model = {"context_length": CONTEXT, "param_dtype": "bf16"}
    loaded = zoo.load(directory, model=model, devices=jax.devices()[:1])
    for variant in [*bf16_rows.runnable(), None]:
        force = mock.patch.object(bf16_rows, "chosen", lambda variant=variant: variant)
        with force:  # the session's float32 copies are made, or not, as it starts
            run = session_timer(loaded.model, loaded.activate, batch, _own_sampling_loop())
        sides[f"bf16, {variant or 'float32 copies'}"] = _forced(run, force)
    for run in sides.values():
        run(prompts, 4)  # compiled, warm
    times: dict[str, list] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, run in sides.items():
            times[name].append(run(prompts, new))
    return {name: rates(pairs, batch, prompt, new) for name, pairs in times.items()}


def _own_sampling_loop() -> Any:
    """A copy of `zoo.models.sampling_loop` with compiled steps of its own: the steps are
    compiled for the kernel taken while they are traced, and a session of another module's
    steps, over the same model, would reuse them."""
    import importlib.util

    spec = importlib.util.find_spec("zoo.models.sampling_loop")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _forced(run: Timed, force: Any) -> Timed:
    def forced(prompts: np.ndarray, new: int) -> tuple[float, float]:
        with force:
            return run(prompts, new)

    return forced


def kernels_table(results: dict) -> str:
    names = list(results["cases"][0]["rates"])
    lines = [
        "| batch | " + " | ".join(f"{n} decode tok/s" for n in names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for case in results["cases"]:
        rates_ = case["rates"]
        fp32 = rates_["fp32"]["decode_tokens_per_s"]
        cells = [f"{r['decode_tokens_per_s']:.1f}" for r in rates_.values()]
        cells[1:] = [f"{c} ({float(c) / fp32:.2f}x)" for c in cells[1:]]
        lines.append(f"| {case['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rates(pairs: list[tuple[float, float]], batch: int, prompt: int, new: int) -> dict:
    """Prefill and decode tokens/s from the medians of rounds' (seconds to the first new token,
    seconds of the rest) for `batch` prompts of `prompt` tokens and `new` new tokens each."""
    first = statistics.median(p[0] for p in pairs)
    rest = statistics.median(p[1] for p in pairs)
    return {
        "prefill_tokens_per_s": batch * prompt / first,
        "decode_tokens_per_s": batch * (new - 1) / rest,
    }


def table(results: dict) -> str:
    head = (
        "| model | dtype | batch | zoo prefill tok/s | transformers prefill tok/s | "
        "zoo decode tok/s | transformers decode tok/s | decode zoo / transformers |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for case in results["cases"]:
        z, t = case["zoo"], case["transformers"]
        lines.append(
            f"| {case['model']} | {case['dtype']} | {case['batch']} | "
            f"{z['prefill_tokens_per_s']:.0f} | {t['prefill_tokens_per_s']:.0f} | "
            f"{z['decode_tokens_per_s']:.1f} | {t['decode_tokens_per_s']:.1f} | "
            f"{case['decode_x_transformers']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=32, help="tokens of each prompt")
    parser.add_argument("--new", type=int, default=33, help="new tokens of each prompt")
    parser.add_argument("--only", help="run the cases of this model only (gpt2-small, ...)")
    parser.add_argument("--cache", type=Path, default=CACHE, help="where checkpoints are kept")
    parser.add_argument(
        "--single-thread",
        action="store_true",
        help="both sides on one thread (XLA's and PyTorch's): for a machine others share",
    )
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="zoo alone: float32 and bfloat16 on each variant of its bfloat16 CPU kernel",
    )
    parser.add_argument(
        "--as-cpu",
        choices=sorted(AS_CPU),
        help="both sides held to the instructions of an AVX-512 F CPU without bfloat16 ones",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.update(AS_CPU.get(args.as_cpu, {}))
    threads = 1 if args.single_thread else len(os.sched_getaffinity(0))
    if args.single_thread:  # before jax is imported
        flags = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
    if args.kernels:
        return kernels_main(args)
    import torch

    torch.set_num_threads(threads)
    directories = {
        "gpt2-small": gpt2_checkpoint(args.cache / "gpt2-small-random"),
        "qwen3-0.6b": make_checkpoint(args.cache / "qwen3-0.6b-random"),
    }
    results: dict = {"threads": threads, "prompt": args.prompt, "new": args.new}
    results |= {"as_cpu": args.as_cpu, "cases": []}
    for name, dtype, batch in CASES:
        if args.only and name != args.only:
            continue
        case = measure(directories[name], dtype, batch, args.prompt, args.new, args.repeats)
        results["cases"].append({"model": name, "dtype": dtype, "batch": batch, **case})
        print(table({"cases": results["cases"][-1:]}).splitlines()[-1], flush=True)
    print(table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


def kernels_main(args: argparse.Namespace) -> None:
    directory = make_checkpoint(args.cache / "qwen3-0.6b-random")
    results: dict = {"prompt": args.prompt, "new": args.new, "cases": []}
    for batch in (1, 8):
        case = kernel_variants(directory, batch, args.prompt, args.new, args.repeats)
        results["cases"].append({"batch": batch, "rates": case})
        print(kernels_table({"cases": results["cases"][-1:]}).splitlines()[-1], flush=True)
    print(kernels_table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

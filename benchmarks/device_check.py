"""What a CPU cannot tell about zoo on an accelerator, in one command: every registered model's
default run for a few steps, GPT-2 small's bf16 training speed, a LoRA and a QLoRA step of
Qwen3-0.6B's architecture, bf16 decoding speed, and whether cuDNN's attention is taken where it
should be. Random weights throughout (no download); under 8 minutes on one GPU.

    python -m benchmarks.device_check --json runs/bench/device_check.json
    python -m benchmarks.device_check --small   # tiny shapes, on a CPU, in about a minute

Sections (`--only` picks some of the first four, `--models` some models):
- `models`: each registered model at its defaults (`--small`: its `tiny` overrides), on one
  device, through the trainer's real loop (`benchmarks.loops.zoo_loop`): the seconds to its
  first step (compilation included), steps/s over `--steps` more, and the loss of its first
  eval batch after them (finite). A model whose default data set is not on the machine (the
  image sets download when first used; nothing is downloaded here) trains at its defaults on
  random examples of that set's shape, and its row says so.
- `gpt2`: GPT-2 small (12 layers, width 768, 12 heads, context 1024, vocabulary 50,257, batch
  16; `benchmarks.throughput`'s sizes and FLOP count) trained with `trainer.precision=bf16`:
  tokens/s and MFU against the device's dense bf16 peak (`PEAK_BF16_TFLOPS` by its name, or
  `--peak-tflops`; on a CPU a measured float32 matmul), medians over `--rounds` rounds.
- `qwen3`: Qwen3-0.6B's architecture (its published config.json: 28 layers, width 1,024, 16
  query and 8 key/value heads of 128, MLP 3,072, vocabulary 151,936, tied embeddings), params in
  bfloat16, LoRA of rank 16 on every projection, its base kernels as they are (`lora`) or nf4
  (`qlora`), batch 8 of 1,024 tokens: the seconds of a step (median after a warm one), the
  compiled step's memory (XLA's analysis) and the device's peak memory (`peak_bytes_in_use`,
  where the backend keeps it: each case in a fresh process, since no peak can be reset).
- `decode`: the same architecture in bfloat16 (random weights) decoding greedily through a
  `Session`, batches of 1 and 8, 32-token prompts, 33 new tokens: prefill and decode tokens/s,
  medians over `--rounds` rounds after a warm one (`benchmarks.decode`'s timing).
- `cudnn`: from the compiled programs of the steps above (their HLO text), whether a cuDNN
  fused attention call (`__cudnn$fmha...`) is in each, against what the attention's route
  (`zoo.engine.kernels.attention.route`) asks for on this platform: GPT-2's and Qwen3's
  training steps should take it on an NVIDIA GPU of compute capability 8.0 or more (not on
  packed rows), a decoding step never.

It prints a table per section under the device's name, jax's version and the date, writes one
JSON with every figure (`--json`), and exits with 1 if any check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from flax import nnx
from zoo.engine import registry
from zoo.engine.errors import ZooError
from zoo.engine.kernels.attention import Call, current_platform, route
from zoo.engine.loop.build import build_on_mesh
from zoo.engine.loop.trainer import evaluate_batches
from zoo.engine.report import memory
from zoo.engine.sharding import mesh as sharding
from zoo.engine.steps.functions import means
from zoo.models.kv_cache import Slots

import zoo
from benchmarks import decode, loops, machine, throughput
from benchmarks.decoder_costs import CONFIG as QWEN3_0_6B
from benchmarks.decoder_costs import qwen3_model
from benchmarks.run import _timed, benchmark_trainer, spread
from zoo.trained import resolved_hparams

SECTIONS = ("models", "gpt2", "qwen3", "decode")
SMALL_GPT2 = {"depth": 1, "dim": 64, "heads": 2, "context": 64, "vocab": 256, "batch": 4}
SMALL_QWEN3 = {
    **QWEN3_0_6B,
    "num_hidden_layers": 1,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 512,
}
QWEN3_STEP = {"batch": 8, "window": 1024}
SMALL_QWEN3_STEP = {"batch": 2, "window": 32}
LORA = ("model.param_dtype=bf16", "finetune.lora_rank=16", "finetune.lora_layers=layers")
CASES = {"lora": (), "qlora": ("finetune.quantize=nf4",)}
DECODE_BATCHES, PROMPT = (1, 8), 32
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))
"""Dense bfloat16 peaks of the datasheets, by a part of the device's name (first match)."""
SMALL_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
"""`--small`'s: tiny programs take longer to compile than to run, and their figures check the
script, not a machine (flags already in XLA_FLAGS come after these and win)."""
CUDNN_CALL = "__cudnn$fmha"
ROOT = Path(__file__).resolve().parents[1]


def has_cudnn_attention(compiled: Any) -> bool:
    """Whether a compiled program calls cuDNN's fused attention."""
    return CUDNN_CALL in compiled.as_text()


def cudnn_row(name: str, compiled: Any, head_dim: int, **call: bool) -> dict[str, Any]:
    """What the route asks for a bf16 causal attention `call` on this platform, and what the
    compiled program does."""
    described = Call(jnp.dtype(jnp.bfloat16), head_dim, causal=True, **call)
    asked = route(current_platform(), described).kernel
    taken = has_cudnn_attention(compiled)
    return {"step": name, "route": asked, "cudnn": taken, "ok": taken == (asked == "cudnn")}


# ---- models ----


@dataclasses.dataclass(frozen=True)
class RunData:
    """What a model's run trains on: config `keys`, and `splits` in place of the registered
    data set (None: the config's), named in its row as `name`."""

    keys: list[str]
    splits: registry.Splits | None = None
    name: str | None = None


def run_data(name: str, small: bool) -> RunData:
    """The model's tiny keys (`small`); else its default data set read from this machine
    only (no download), or, where its files are not here, random examples of its shape."""
    entry = registry.get_model(name)
    if small:
        return RunData(list(entry.tiny))
    data = registry.get_data(entry.default_data)
    if "download" not in data.config.__dataclass_fields__:
        return RunData([])
    try:
        zoo.load_data(entry.default_data, download=False)
    except ZooError:
        return stand_in(name, entry.default_data, data.info)
    return RunData(["data.download=false"])


def stand_in(name: str, data: str, facts: dict[str, Any]) -> RunData:
    """Random examples shaped as data set `data`'s (pixels in [0, 1), labels of its classes)
    and the model keys its facts would have set: the model at its defaults, its loss on noise."""
    defaults = zoo.compose([f"model={name}"]).model
    keys = [
        f"model.{key}={json.dumps(list(value) if isinstance(value, tuple) else value)}"
        for key, value in facts.items()
        if key in defaults and defaults[key] is None
    ]
    rng = np.random.default_rng(0)

    def split(size: int) -> dict[str, np.ndarray]:
        images = rng.random((size, *facts["input_shape"]), np.float32)
        return {"image": images, "label": rng.integers(0, facts["num_classes"], size)}

    shape = "x".join(map(str, facts["input_shape"]))
    return RunData(keys, registry.Splits(split(1024), split(256)), f"random {shape} (no {data})")


def model_run(name: str, data: RunData, steps: int, workdir: str) -> dict[str, Any]:
    """One model's row: seconds to the first step, steps/s over `steps` more, the loss."""
    devices = jax.devices()[:1]
    trainer = benchmark_trainer(name, f"{workdir}/{name}", data.keys, devices, data.splits)
    advance = loops.zoo_loop(trainer)
    try:
        first = _timed(advance, 1)
        rest = _timed(advance, steps)
    finally:
        advance.close()  # type: ignore[attr-defined]
    loss = evaluate_batches(
        trainer.eval_step,
        trainer.state,
        [trainer.eval_data[0]],
        trainer.mesh,
        trainer.rules,
        trainer.eval_key,
    )["loss"]
    return {
        "model": name,
        "data": data.name or trainer.cfg.data.name,
        "params": trainer.param_count,
        "first_step_seconds": first,
        "steps_per_sec": steps / rest,
        "loss": loss,
        "ok": math.isfinite(loss),
    }


def models(names: Sequence[str], small: bool, steps: int, workdir: str) -> list[dict[str, Any]]:
    """Each model's row; a model that fails says why, and the others still run."""
    rows = []
    for name in names:
        try:
            rows.append(model_run(name, run_data(name, small), steps, workdir))
        except Exception as e:  # noqa: BLE001  (an acceptance check reports every failure)
            rows.append({"model": name, "ok": False, "error": f"{type(e).__name__}: {e}"})
    return rows


# ---- gpt2 ----


def peak_flops(device: Any, given_tflops: float | None) -> tuple[float | None, str]:
    """The device's dense bf16 peak FLOP/s and where it comes from (None: unknown)."""
    if given_tflops:
        return given_tflops * 1e12, "--peak-tflops"
    if device.platform == "cpu":
        return throughput.matmul_flops(), "measured float32 matmul"
    for part, tflops in PEAK_BF16_TFLOPS:
        if part in device.device_kind:
            return tflops * 1e12, f"{part} datasheet, dense bf16"
    return None, "unknown device: give --peak-tflops"


def gpt2(sizes: dict[str, int], rounds: int, steps: int, peak_tflops: float | None, workdir: str):
    """GPT-2's bf16 training: tokens/s and MFU; and its compiled step's cuDNN row."""
    trainer = throughput.zoo_trainers(sizes, workdir, precisions=("bf16",))["bf16"]
    compiled, _ = memory.compiled_train_step(trainer)
    dropout = trainer.hparams["dropout_rate"] > 0
    cudnn = cudnn_row(
        "gpt2 bf16 train", compiled, sizes["dim"] // sizes["heads"], cached=False, dropout=dropout
    )
    advance = loops.zoo_loop(trainer)
    try:
        advance(2)  # compiled, warm
        seconds = [_timed(advance, steps) for _ in range(rounds)]
    finally:
        advance.close()  # type: ignore[attr-defined]
    peak, source = peak_flops(jax.devices()[0], peak_tflops)
    per_token = throughput.flops_per_token(trainer)
    tokens = steps * sizes["batch"] * sizes["context"]
    rates = [tokens / s for s in seconds]
    return {
        "sizes": sizes,
        "flops_per_token": per_token,
        "tokens_per_sec": spread(rates),
        "mfu": spread([r * per_token / peak for r in rates]) if peak else None,
        "peak_flops": peak,
        "peak_source": source,
        "per_round_seconds": seconds,
    }, cudnn


# ---- qwen3 (each case in a process of its own) ----


def qwen3_case(case: str, small: bool, steps: int) -> dict[str, Any]:
    """In this (fresh) process: a LoRA or QLoRA step of the Qwen3 architecture, timed from the
    one compilation that also gives its memory and its program."""
    config, shape = (SMALL_QWEN3, SMALL_QWEN3_STEP) if small else (QWEN3_0_6B, QWEN3_STEP)
    keys = [
        *qwen3_model(config)[1:],  # its first key, model=decoder, is the trainer's own
        *LORA,
        *CASES[case],
        "data=text",
        f"data.window={shape['window']}",
        f"trainer.batch_size={shape['batch']}",
    ]
    with tempfile.TemporaryDirectory() as workdir:
        trainer = benchmark_trainer("decoder", workdir, keys, jax.devices()[:1])
        started = time.perf_counter()
        compiled, (state, sums, batch, key) = memory.compiled_train_step(trainer)
        compile_seconds = time.perf_counter() - started
        seconds = []
        with sharding.activate(trainer.mesh, trainer.rules):
            for _ in range(steps + 1):  # the first one warm-up
                started = time.perf_counter()
                state, sums = compiled(state, sums, batch, key)
                jax.block_until_ready(state)
                seconds.append(time.perf_counter() - started)
    packed = registry.SEGMENT_IDS in batch
    loss = means(sums)["loss"]
    return {
        "case": case,
        "ok": math.isfinite(loss),
        "params": trainer.param_count,
        "compile_seconds": compile_seconds,
        "step_seconds": statistics.median(seconds[1:]),
        "loss": loss,
        "compiled_memory": memory.memory_of(compiled),
        "device_memory": memory.device_memory(jax.devices()[:1]),
        "cudnn": cudnn_row(
            f"qwen3 {case} train",
            compiled,
            config["head_dim"],
            cached=False,
            dropout=False,
            packed=packed,
        ),
    }


def qwen3(small: bool, steps: int) -> dict[str, dict[str, Any]]:
    """Each case's figures, from a fresh interpreter (`--case`), or why it failed."""
    results = {}
    for case in CASES:
        command = [sys.executable, "-m", "benchmarks.device_check", "--case", case]
        command += ["--steps", str(steps), *(["--small"] if small else [])]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
        if done.returncode:
            results[case] = {"case": case, "ok": False, "error": done.stderr.strip()[-2000:]}
            continue
        results[case] = json.loads(done.stdout.strip().splitlines()[-1])
    return results


# ---- decode ----


def decoder_for_decoding(config: dict[str, Any]) -> tuple[nnx.Module, Callable[[], Any]]:
    """The Qwen3 architecture in bfloat16 with random weights on one device, in eval mode,
    its context cut to `decode.CONTEXT`; and the context its mesh is activated by."""
    keys = [
        *qwen3_model(config),
        "model.param_dtype=bf16",
        f"model.context_length={decode.CONTEXT}",
    ]
    cfg = zoo.compose([*keys, "data=text"])
    mesh, rules = sharding.mesh_and_rules(cfg.mesh, jax.devices()[:1])
    entry = registry.get_model("decoder")
    model = build_on_mesh(entry, resolved_hparams(cfg), cfg.seed, mesh, rules).model
    model.eval()
    return model, lambda: sharding.activate(mesh, rules)


def decode_step(model: nnx.Module, activate: Callable[[], Any], batch: int) -> Any:
    """A decoding step of `batch` rows at slot `PROMPT` of a `decode.CONTEXT`-slot cache,
    compiled (for its program)."""
    with activate():
        cache = model.empty_cache(batch, decode.CONTEXT)
        slots = Slots(jnp.int32(PROMPT), jnp.zeros(batch, jnp.int32), prefill=False)
        tokens = jnp.zeros((batch, 1), jnp.int32)
        step = nnx.jit(lambda m, t, c, s: m.decode(t, c, s)[0])
        return step.lower(model, tokens, cache, slots).compile()


def decoding(small: bool, new: int, repeats: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Prefill and decode tokens/s at each of `DECODE_BATCHES`; a decoding step's cuDNN row."""
    config = SMALL_QWEN3 if small else QWEN3_0_6B
    model, activate = decoder_for_decoding(config)
    rows = []
    for batch in DECODE_BATCHES:
        prompts = np.random.default_rng(0).integers(1, 500, (batch, PROMPT)).astype(np.int32)
        timer = decode.session_timer(model, activate, batch)
        timer(prompts, 4)  # compiled, warm
        pairs = [timer(prompts, new) for _ in range(repeats)]
        rows.append({"batch": batch, **decode.rates(pairs, batch, PROMPT, new)})
    compiled = decode_step(model, activate, max(DECODE_BATCHES))
    cudnn = cudnn_row("qwen3 bf16 decode", compiled, config["head_dim"], cached=True, dropout=False)
    return rows, cudnn


# ---- the report ----


def header(device: Any) -> dict[str, Any]:
    return {
        "device": device.device_kind,
        "platform": device.platform,
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "matmul_precision": jax.config.jax_default_matmul_precision,
        "cpu": machine.cpu(),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every section `args.only` names, timed; `ok` only if every check passed."""
    report = header(jax.devices()[0])
    report |= {"small": args.small, "cudnn": [], "section_seconds": {}}
    clock = SectionClock(report["section_seconds"])
    with tempfile.TemporaryDirectory() as workdir:
        if "models" in args.only:
            with clock("models"):
                report["models"] = models(args.models, args.small, args.steps, workdir)
        if "gpt2" in args.only:
            sizes = SMALL_GPT2 if args.small else throughput.GPU_SIZES
            with clock("gpt2"):
                report["gpt2"], cudnn = gpt2(
                    sizes, args.rounds, args.steps, args.peak_tflops, workdir
                )
            report["cudnn"].append(cudnn)
    if "qwen3" in args.only:
        with clock("qwen3"):
            report["qwen3"] = qwen3(args.small, args.steps)
        report["cudnn"] += [c["cudnn"] for c in report["qwen3"].values() if "cudnn" in c]
    if "decode" in args.only:
        with clock("decode"):
            report["decode"], cudnn = decoding(args.small, args.new, args.rounds)
        report["cudnn"].append(cudnn)
    checks = [*report.get("models", []), *report.get("qwen3", {}).values(), *report["cudnn"]]
    report["ok"] = all(check["ok"] for check in checks)
    report["seconds"] = sum(report["section_seconds"].values())
    return report


class SectionClock:
    """`with clock(name):` adds the wall seconds of the block to `seconds[name]`."""

    def __init__(self, seconds: dict[str, float]):
        self.seconds = seconds

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = time.perf_counter() - started


def table(report: dict[str, Any]) -> str:
    """The report as Markdown tables, under the device, jax's version and the date."""
    lines = [
        f"{report['device']} ({report['platform']}, {report['device_count']} devices), "
        f"jax {report['jax']}, {report['date']}; "
        f"{'passed' if report['ok'] else 'FAILED'} in {report['seconds']:.0f} s ("
        + ", ".join(f"{name} {s:.0f} s" for name, s in report["section_seconds"].items())
        + ")",
        machine.describe(report["cpu"]),
    ]
    if "models" in report:
        lines += [
            "",
            "| model | data | params | first step s | steps/s | loss |",
            "|---|---|---|---|---|---|",
        ]
        for r in report["models"]:
            if "error" in r:
                lines.append(f"| {r['model']} | FAILED: {r['error'][:200]} | | | | |")
                continue
            lines.append(
                f"| {r['model']} | {r['data']} | {r['params']:,} | {r['first_step_seconds']:.1f} "
                f"| {r['steps_per_sec']:.1f} | {r['loss']:.4f} |"
            )
    if "gpt2" in report:
        g = report["gpt2"]
        mfu = f"{100 * g['mfu']['median']:.1f}%" if g["mfu"] else "-"
        lines += [
            "",
            (
                f"gpt2 bf16 training ({g['sizes']}): {g['tokens_per_sec']['median']:,.0f} tokens/s, "
                f"MFU {mfu} (peak: {g['peak_source']})"
            ),
        ]
    if "qwen3" in report:
        lines += [
            "",
            "| qwen3 step | step s | compiled peak | device peak | loss |",
            "|---|---|---|---|---|",
        ]
        for name, r in report["qwen3"].items():
            if "error" in r:
                lines.append(f"| {name} | FAILED: {r['error'][-200:]} | | | |")
                continue
            compiled = (r["compiled_memory"] or {}).get("peak")
            device = r["device_memory"].get("device_peak_bytes")
            lines.append(
                f"| {name} | {r['step_seconds']:.3f} | {_mib(compiled)} | {_mib(device)} "
                f"| {r['loss']:.4f} |"
            )
    if "decode" in report:
        lines += ["", "| decode batch | prefill tok/s | decode tok/s |", "|---|---|---|"]
        for r in report["decode"]:
            lines.append(
                f"| {r['batch']} | {r['prefill_tokens_per_s']:,.0f} "
                f"| {r['decode_tokens_per_s']:,.1f} |"
            )
    if report["cudnn"]:
        lines += ["", "| attention of | route asks | cuDNN in HLO | ok |", "|---|---|---|---|"]
        for r in report["cudnn"]:
            lines.append(f"| {r['step']} | {r['route']} | {r['cudnn']} | {r['ok']} |")
    return "\n".join(lines)


def _mib(size: int | None) -> str:
    return "-" if size is None else f"{size / 2**20:,.0f} MiB"


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes, for a CPU")
    parser.add_argument(
        "--only", type=lambda s: s.split(","), default=list(SECTIONS), help=",".join(SECTIONS)
    )
    parser.add_argument(
        "--models",
        type=lambda s: s.split(","),
        default=zoo.list_models(),
        help="the models of the models section (default: every registered one)",
    )
    parser.add_argument("--steps", type=int, help="timed steps (default: 10; --small: 2)")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds of gpt2 and decode")
    parser.add_argument("--new", type=int, help="new tokens per prompt (default: 33; --small: 5)")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--case", choices=list(CASES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for option, given, known in (
        ("only", args.only, SECTIONS),
        ("models", args.models, zoo.list_models()),
    ):
        if unknown := sorted(set(given) - set(known)):
            parser.error(f"--{option} {','.join(unknown)}: choose from {', '.join(known)}")
    args.steps = args.steps or (2 if args.small else 10)
    args.new = args.new or (5 if args.small else 33)
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    # The qwen3 cases' processes share the device with this one: each takes memory as it needs
    # it, not 75% of the device up front (and peak_bytes_in_use counts what a case uses).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if args.small:  # before this process's backend starts, and for the qwen3 cases' processes
        os.environ["XLA_FLAGS"] = f"{SMALL_XLA_FLAGS} {os.environ.get('XLA_FLAGS', '')}".strip()
    if args.case:  # one of `qwen3`'s processes: its figures, the last line of its stdout
        result = qwen3_case(args.case, args.small, args.steps)
        print(json.dumps(result))
        return result
    report = measure(args)
    print(table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    # A case's process has done its part once it has printed its figures, a failed check
    # among them: the check's own process fails if any check did.
    result = main()
    sys.exit(0 if "case" in result or result["ok"] else 1)

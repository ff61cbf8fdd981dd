"""What a checkpoint of Qwen3-0.6B's architecture costs on this machine, held in bfloat16: its
load against reading its safetensors into numpy, a LoRA fine-tuning step, a generated token.

    python -m benchmarks.decoder_costs --repeats 3 --json runs/bench/decoder.json

The checkpoint is made here once (random weights, numpy + safetensors; no download): Qwen3-0.6B's
`config.json` as the hub has it (transformers 4's layout: 28 layers, width 1,024, 16 query heads
and 8 key/value heads of 128, MLP 3,072, vocabulary 151,936, tied output) and 596M params in a
1.19 GB bfloat16 file. Each figure comes from a fresh interpreter, one device:

- load: `zoo.load(DIR, model={"param_dtype": "bf16"})` against `safetensors.numpy.load_file`,
  their wall time (after the imports) and peak host memory (`VmHWM`) less that of an interpreter
  that imported the same and did nothing; the cases interleaved round after round. Goals: at
  most 1.5x the numpy read's time, a peak of at most 1.5x the file.
- LoRA step: zoo's trainer on `finetune.init_from=DIR` with `model.param_dtype=bf16` and LoRA of
  rank 16 on every attention and MLP projection, batch 1 of 256 tokens; steps/s of its warm loop
  (after compilation), the compiled step's memory from XLA's analysis, the process's peak.
- decode: a token generated greedily by `zoo.generate` after a 32-token prompt, the model's
  context cut to 512 positions (`model.context_length=512`: the key/value cache is that long),
  seconds per token after a warm-up call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.pretrained_loading import CACHE, peak_resident_bytes

WEIGHTS = "model.safetensors"
CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
BF16 = ("model.param_dtype=bf16",)
"""The fine-tune's override; `zoo.load` takes the same as `model={"param_dtype": "bf16"}`."""
LORA = ("finetune.lora_rank=16", "finetune.lora_layers=layers")
TOKENS, CONTEXT, PROMPT = 256, 512, 32


def qwen3_shapes():
    """(key, shape) of every tensor of the checkpoint."""
    c = CONFIG
    width, heads, kv, head = (
        c["hidden_size"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["head_dim"],
    )
    yield "model.embed_tokens.weight", (c["vocab_size"], width)
    for i in range(c["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        yield f"{layer}.input_layernorm.weight", (width,)
        yield f"{layer}.post_attention_layernorm.weight", (width,)
        yield f"{layer}.self_attn.q_proj.weight", (heads * head, width)
        yield f"{layer}.self_attn.k_proj.weight", (kv * head, width)
        yield f"{layer}.self_attn.v_proj.weight", (kv * head, width)
        yield f"{layer}.self_attn.o_proj.weight", (width, heads * head)
        yield f"{layer}.self_attn.q_norm.weight", (head,)
        yield f"{layer}.self_attn.k_norm.weight", (head,)
        yield f"{layer}.mlp.gate_proj.weight", (c["intermediate_size"], width)
        yield f"{layer}.mlp.up_proj.weight", (c["intermediate_size"], width)
        yield f"{layer}.mlp.down_proj.weight", (width, c["intermediate_size"])
    yield "model.norm.weight", (width,)


def qwen3_model(config: dict = CONFIG) -> list[str]:
    """The config keys of the decoder that a Qwen 3 `config.json` makes, as
    `finetune.init_from` sets them: the architecture, with no checkpoint read."""
    from zoo.engine import registry

    (qwen3,) = [family for family in registry.families("decoder") if family.name == "qwen3"]
    hparams = qwen3.hparams(config)
    return ["model=decoder", *(f"model.{key}={json.dumps(v)}" for key, v in hparams.items())]


def make_checkpoint(directory: Path) -> Path:
    """The random checkpoint in `directory` (with a byte-level tokenizer of the vocabulary's
    size, for the fine-tuning data), written once and reused."""
    import ml_dtypes
    from safetensors.numpy import save_file

    if (directory / WEIGHTS).is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    tensors = {}
    for key, shape in qwen3_shapes():
        if key.endswith("norm.weight"):
            values = 1 + 0.1 * rng.standard_normal(shape, np.float32)
        else:
            values = 0.02 * rng.standard_normal(shape, np.float32)
        tensors[key] = values.astype(ml_dtypes.bfloat16)
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=2))
    save_file(tensors, str(directory / f"{WEIGHTS}.partial"), metadata={"format": "pt"})
    os.replace(directory / f"{WEIGHTS}.partial", directory / WEIGHTS)
    return directory


def text_file(directory: Path) -> Path:
    """A few hundred KB of text to fine-tune on (byte tokens fit any vocabulary)."""
    path = directory / "text.txt"
    if not path.is_file():
        words = np.random.default_rng(1).integers(97, 123, 400_000).astype(np.uint8)
        words[::7] = ord(" ")
        path.write_bytes(words.tobytes())
    return path


def measure(what: str, directory: str) -> dict[str, float]:
    """In this (fresh) interpreter: the figures of `what`, and the process's peak memory."""
    import jax

    jax.devices()
    result: dict[str, float] = {}
    if what == "zoo":  # the library's import is not the load's: timed apart
        started = time.perf_counter()
        import zoo

        result["import_seconds"] = time.perf_counter() - started
    started = time.perf_counter()
    if what == "numpy":
        from safetensors.numpy import load_file

        arrays = load_file(os.path.join(directory, WEIGHTS))
        result["elements"] = sum(a.size for a in arrays.values())
    elif what == "zoo":
        loaded = zoo.load(directory, model={"param_dtype": "bf16"})
        leaves = jax.tree.leaves(loaded.model)
        jax.block_until_ready(leaves)
        result["elements"] = sum(x.size for x in leaves)
    elif what == "lora":
        result.update(_lora_step(directory))
    elif what == "decode":
        result.update(_decode(directory))
    result["seconds"] = time.perf_counter() - started
    result["peak_bytes"] = peak_resident_bytes()
    return result


def _lora_step(directory: str) -> dict[str, float]:
    import jax
    from zoo.engine.loop.trainer import Trainer
    from zoo.engine.report.memory import step_memory

    import zoo
    from benchmarks import loops
    from benchmarks.run import _timed

    with tempfile.TemporaryDirectory() as workdir:
        overrides = [
            f"finetune.init_from={directory}",
            "data=text",
            f"data.path={text_file(Path(directory))}",
            f"data.window={TOKENS}",
            "trainer.batch_size=1",
            "trainer.steps=1000",
            "trainer.log_every=2",
            "trainer.eval_every=0",
            "trainer.checkpoint_every=0",
            "logging.norms_every=0",
            *BF16,
            *LORA,
            f"workdir={workdir}",
        ]
        trainer = Trainer(zoo.compose(overrides), jax.devices()[:1])
        memory = step_memory(trainer)
        advance = loops.zoo_loop(trainer)
        try:
            advance(2)  # compilation and caches
            seconds = [_timed(advance, 2) / 2 for _ in range(3)]
        finally:
            advance.close()  # type: ignore[attr-defined]
    return {
        "step_seconds": statistics.median(seconds),
        **{f"step_{k}": v for k, v in memory.items()},
    }


def _decode(directory: str) -> dict[str, float]:
    """The engine's session itself: the checkpoint has no tokenizer, so its ids are no text."""
    from zoo.models.sampling_loop import Sampling, Session

    import zoo

    loaded = zoo.load(directory, model={"param_dtype": "bf16", "context_length": CONTEXT})
    prompt = np.arange(PROMPT, dtype=np.int32) + 1000
    greedy = Sampling(temperature=0)
    with loaded.activate():
        session = Session(loaded.model, 1, CONTEXT)
        session.generate([prompt], 4, greedy)  # compiled and warm
        times = []
        for new in (8, 40):
            start = time.perf_counter()
            session.generate([prompt], new, greedy)
            times.append(time.perf_counter() - start)
    return {"token_seconds": (times[1] - times[0]) / 32}


def in_fresh_process(what: str, directory: Path) -> dict[str, float]:
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": "1", "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "benchmarks.decoder_costs", "--measure", what]
    command += ["--dir", str(directory)]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run(directory: Path, repeats: int) -> dict:
    """Each case `repeats` times, interleaved round after round; medians."""
    file_bytes = (directory / WEIGHTS).stat().st_size
    params = int(sum(np.prod(s) for _, s in qwen3_shapes()))
    rounds: dict[str, list[dict]] = {name: [] for name in ("baseline", "numpy", "zoo")}
    for _ in range(repeats):
        for name, measured in rounds.items():
            measured.append(in_fresh_process(name, directory))
    base = statistics.median(r["peak_bytes"] for r in rounds["baseline"])
    results: dict = {"file_bytes": file_bytes, "params": params}
    for name in ("numpy", "zoo"):
        seconds = statistics.median(r["seconds"] for r in rounds[name])
        peak = statistics.median(r["peak_bytes"] for r in rounds[name]) - base
        results[name] = {"seconds": seconds, "peak_bytes": peak, "peak_x_file": peak / file_bytes}
    results["zoo"]["time_x_numpy"] = results["zoo"]["seconds"] / results["numpy"]["seconds"]
    lora = in_fresh_process("lora", directory)
    results["lora"] = {**lora, "peak_bytes": lora["peak_bytes"] - base}
    decode = in_fresh_process("decode", directory)
    results["decode"] = {**decode, "peak_bytes": decode["peak_bytes"] - base}
    return results


def table(results: dict) -> str:
    mib = 2**20
    zoo_load, numpy_read = results["zoo"], results["numpy"]
    lora, decode = results["lora"], results["decode"]
    title = (
        f"Qwen3-0.6B's architecture: {results['params']:,} params, "
        f"{results['file_bytes'] / mib:.0f} MiB of bfloat16"
    )
    rows = {
        "numpy read": f"{numpy_read['seconds']:.2f} s, peak {numpy_read['peak_bytes'] / mib:.0f} MiB",
        "zoo.load, bf16 params": (
            f"{zoo_load['seconds']:.2f} s ({zoo_load['time_x_numpy']:.2f}x numpy), peak "
            f"{zoo_load['peak_bytes'] / mib:.0f} MiB ({zoo_load['peak_x_file']:.2f}x the file)"
        ),
        f"LoRA step (rank 16, batch 1 x {TOKENS})": (
            f"{lora['step_seconds']:.2f} s; compiled step {lora['step_peak'] / mib:.0f} MiB "
            f"(arguments {lora['step_arguments'] / mib:.0f}, temporaries "
            f"{lora['step_temporaries'] / mib:.0f}); process peak {lora['peak_bytes'] / mib:.0f} MiB"
        ),
        "a generated token (greedy, batch 1)": f"{decode['token_seconds'] * 1000:.0f} ms",
    }
    lines = [title, "", "| | figure |", "|---|---|"]
    return "\n".join(lines + [f"| {name} | {figure} |" for name, figure in rows.items()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=CACHE, help="where the checkpoint is kept")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--measure", choices=["baseline", "numpy", "zoo", "lora", "decode"], help=argparse.SUPPRESS
    )
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.dir)))
        return
    directory = make_checkpoint(args.cache / "qwen3-0.6b-random")
    results = run(directory, args.repeats)
    print(table(results))
    print(json.dumps(results, indent=2, default=float))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=float))


if __name__ == "__main__":
    main()

"""Mixtures of experts on this machine: the grouped product against the alternatives, a small
mixture's training against a dense decoder with as many active params, and the memory of
Qwen3-30B-A3B's train step.

    JAX_NUM_CPU_DEVICES=8 python -m benchmarks.experts --json runs/bench/experts.json

- **product**: one mixture layer's three projections, forward and backward, over `--tokens`
  tokens routed to `--top-k` of `--experts` experts (a random routing): zoo's grouped product
  (`zoo.models.grouped_matmul`), `jax.lax.ragged_dot` (which XLA expands into a dense product
  of every pair with every expert), and a loop over the experts that computes every token with
  every expert and masks (the plain way without a grouped product). Seconds per call after
  `block_until_ready()`, interleaved round by round, and the temporaries XLA's memory analysis
  gives each compiled program.
- **training**: tokens/s of the trainer's real loop (`benchmarks.loops.zoo_loop`), one device,
  for a decoder whose layers are mixtures of `--experts` experts `--expert-width` wide, `--top-k`
  to a token, against the same decoder with one dense MLP `top_k x expert_width` wide (the same
  active params per token, the router aside); interleaved windows, medians.
- **meshes**: the same mixture's training tokens/s on 8 devices with `tensor=2`, its batch split
  4 ways (`data=4`, every device holding every expert) against its experts split 4 ways
  (`expert=4`, expert parallelism: each device computes its experts' pairs of its group's
  tokens); interleaved windows, medians (8 devices: on a CPU, `JAX_NUM_CPU_DEVICES=8`). The
  decoder's other sizes are its defaults, or `--mesh-keys` (e.g. `model.dim=64`).
- **memory**: XLA's memory analysis of the train step compiled on the abstract state (no
  weights: `benchmarks.finetune_memory.step_memory`) of the Qwen3-30B-A3B architecture (its
  hub config, `QWEN3_30B_A3B`), params in bfloat16, each layer recomputed in the backward pass
  (`model.remat=true`), sequences of `--length` tokens: LoRA (rank
  16) over the attention on one device, the experts frozen, batch 1 (a single 141 GB GPU's
  fine-tune); and a full fine-tune (float32 master weights, Adam) on 8 devices split `fsdp=8`,
  `expert=8` or `expert=4` with `fsdp=2`, batch 8 (on a CPU,
  8 simulated ones: `JAX_NUM_CPU_DEVICES=8`). Computed for
  this process's backend (XLA:CPU here: its attention keeps each layer's logits for the
  backward pass, where a GPU's flash attention keeps none).

Prints a table per section, then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from zoo.engine import registry
from zoo.models.grouped_matmul import grouped_matmul

import zoo
from benchmarks import finetune_memory, loops
from benchmarks.run import benchmark_trainer, spread

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
"""The architecture keys of `Qwen/Qwen3-30B-A3B`'s `config.json` on the Hugging Face Hub."""

MEMORY_CASES = {
    "LoRA on the attention, 1 device": (
        (
            "finetune.lora_rank=16",
            r"finetune.lora_layers=layers\.\d+\.attention",
            "model.remat=true",
        ),
        {},
        1,
    ),
    "full fine-tune, fsdp=8": (("model.remat=true",), {"fsdp": 8}, 8),
    "full fine-tune, expert=8": (("model.remat=true",), {"data": 1, "expert": 8}, 8),
    "full fine-tune, expert=4 fsdp=2": (
        ("model.remat=true",),
        {"data": 1, "fsdp": 2, "expert": 4},
        8,
    ),
}
"""Each memory case's fine-tuning keys, mesh and batch (a sequence per device)."""


# ---- product -----------------------------------------------------------------------------------


def routed(tokens: int, experts: int, top_k: int, dim: int, width: int, seed: int = 0):
    """A layer's inputs and kernels, and a random routing of `tokens` to `top_k` of `experts`
    each: (rows sorted by expert [tokens x top_k, dim], the row of each, group sizes, kernels)."""
    rng = np.random.default_rng(seed)
    chosen = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
    flat = chosen.reshape(-1)
    order = np.argsort(flat, kind="stable")
    x = jnp.asarray(rng.normal(size=(tokens, dim)), jnp.float32)
    kernels = [
        jnp.asarray(rng.normal(size=shape) * 0.02, jnp.float32)
        for shape in ((experts, width, dim), (experts, width, dim), (experts, dim, width))
    ]
    sizes = jnp.asarray(np.bincount(flat, minlength=experts), jnp.int32)
    return x, jnp.asarray(order // top_k), jnp.asarray(flat[order]), sizes, kernels


def _ragged(rows, kernels, sizes):
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0],
    )
    return jax.lax.ragged_dot_general(rows, kernels, sizes, numbers)


def _grouped_layer(product: Callable) -> Callable:
    """The experts' gated MLPs over the sorted rows with `product` for each projection; the
    outputs summed back onto their tokens (the router's weights left out: all 1)."""

    def layer(x, token_of, expert_of, sizes, kernels):
        gate, up, down = kernels
        rows = x[token_of]
        middle = jax.nn.silu(product(rows, gate, sizes)) * product(rows, up, sizes)
        return jnp.zeros_like(x).at[token_of].add(product(middle, down, sizes))

    return layer


def _loop_layer(x, token_of, expert_of, sizes, kernels):
    """Every token through every expert, masked to the experts it chose."""
    gate, up, down = kernels
    chose = jnp.zeros((x.shape[0], gate.shape[0]), x.dtype).at[token_of, expert_of].set(1.0)

    def one(total, e):
        middle = jax.nn.silu(x @ gate[e].T) * (x @ up[e].T)
        return total + chose[:, e][:, None] * (middle @ down[e].T), None

    return jax.lax.scan(one, jnp.zeros_like(x), jnp.arange(gate.shape[0]))[0]


PRODUCTS = {
    "grouped": _grouped_layer(grouped_matmul),
    "ragged_dot": _grouped_layer(_ragged),
    "loop": _loop_layer,
}


def product_figures(args: argparse.Namespace) -> dict[str, Any]:
    inputs = routed(args.tokens, args.experts, args.top_k, args.dim, args.expert_width)
    steps = {}
    for name, layer in PRODUCTS.items():
        loss = lambda x, kernels, layer=layer: jnp.sum(layer(x, *inputs[1:4], kernels) ** 2)
        steps[name] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    x, kernels = inputs[0], inputs[4]
    values = {name: float(step(x, kernels)[0]) for name, step in steps.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            jax.block_until_ready(step(x, kernels))
            times[name].append(time.perf_counter() - start)
    memory = {
        name: step.lower(x, kernels).compile().memory_analysis().temp_size_in_bytes
        for name, step in steps.items()
    }
    return {
        name: {
            "seconds": spread(times[name]),
            "temporaries": memory[name],
            "loss": values[name],
            "vs_grouped": statistics.median(
                t / g for t, g in zip(times[name], times["grouped"], strict=True)
            ),
        }
        for name in steps
    }


# ---- training ----------------------------------------------------------------------------------


def training_figures(args: argparse.Namespace) -> dict[str, Any]:
    mixture = [
        f"model.num_experts={args.experts}",
        f"model.experts_per_token={args.top_k}",
        f"model.expert_mlp_dim={args.expert_width}",
    ]
    variants = {"mixture": mixture, "dense": [f"model.mlp_dim={args.top_k * args.expert_width}"]}
    return interleaved_training(args, variants, "dense", jax.devices()[:1])


def mesh_figures(args: argparse.Namespace) -> dict[str, Any]:
    """The default decoder with `--experts` experts, `--top-k` to a token, on 8 devices with
    tensor=2: the batch split 4 ways (`data=4`, every device all the experts) against the
    experts split 4 ways (`expert=4`)."""
    if len(jax.devices()) < 8:
        raise SystemExit("The meshes section needs 8 devices: on a CPU, JAX_NUM_CPU_DEVICES=8.")
    mixture = [
        f"model.num_experts={args.experts}",
        f"model.experts_per_token={args.top_k}",
        *args.mesh_keys,
    ]
    variants = {
        "data=4": [*mixture, "mesh.tensor=2", "mesh.data=4"],
        "expert=4": [*mixture, "mesh.tensor=2", "mesh.data=1", "mesh.expert=4"],
    }
    return interleaved_training(args, variants, "data=4", jax.devices()[:8], sized=False)


def interleaved_training(
    args: argparse.Namespace,
    variants: dict[str, list[str]],
    baseline: str,
    devices: list,
    sized: bool = True,
) -> dict[str, Any]:
    """Tokens/s of the trainer's real loop for each of `variants` (a decoder's keys, beside
    `args`' sizes where `sized`, else at the decoder's defaults) on `devices`, in interleaved
    windows, and each one's median speed against `baseline`'s in the same rounds."""
    sizes = [
        f"model.depth={args.depth}",
        f"model.dim={args.dim}",
        "model.num_heads=4",
        f"model.context_length={args.context}",
        f"data.window={args.context}",
    ]
    if sized:
        sizes.append(f"trainer.batch_size={args.batch}")
    sizes = [*(sizes if sized else []), "logging.norms_every=0"]
    with tempfile.TemporaryDirectory() as workdir:
        advances, tokens = {}, {}
        for name, extra in variants.items():
            folder = f"{workdir}/{name.replace('=', '')}"
            trainer = benchmark_trainer("decoder", folder, [*sizes, *extra], devices)
            advances[name] = loops.zoo_loop(trainer)
            advances[name](1)  # compiles
            batch = int(trainer.cfg.trainer.batch_size) * int(trainer.cfg.data.window)
            tokens[name] = args.steps * batch
        seconds: dict[str, list[float]] = {name: [] for name in advances}
        for _ in range(args.rounds):
            for name, advance in advances.items():
                start = time.perf_counter()
                advance(args.steps)
                seconds[name].append(time.perf_counter() - start)
        for advance in advances.values():
            advance.close()
    return {
        name: {
            "tokens_per_second": spread([tokens[name] / s for s in seconds[name]]),
            f"vs_{baseline}": statistics.median(
                b / s for s, b in zip(seconds[name], seconds[baseline], strict=True)
            ),
        }
        for name in seconds
    }


# ---- memory ------------------------------------------------------------------------------------


def memory_overrides(
    config: dict[str, Any], extra: Sequence[str], mesh: dict, batch: int
) -> list[str]:
    """The run's keys: the model `config` makes (as `finetune.init_from` reads it), in bfloat16,
    with `extra`, `mesh` and `batch`."""
    (family,) = [f for f in registry.families("decoder") if f.name == config["model_type"]]
    hparams = family.hparams(config)
    return [
        "model=decoder",
        "data=chat",
        *(f"model.{key}={json.dumps(value)}" for key, value in hparams.items()),
        "model.param_dtype=bf16",
        f"trainer.batch_size={batch}",
        *(f"mesh.{axis}={size}" for axis, size in mesh.items()),
        *extra,
    ]


def memory_figures(config: dict[str, Any], length: int) -> dict[str, Any]:
    rows = {}
    for name, (extra, mesh, batch) in MEMORY_CASES.items():
        cfg = zoo.compose(memory_overrides(config, extra, mesh, batch))
        count = int(np.prod(list(mesh.values()) or [1]))
        if len(jax.devices()) < count:
            raise SystemExit(
                f"The memory case '{name}' needs {count} devices and this process has "
                f"{len(jax.devices())}: on a CPU, run with JAX_NUM_CPU_DEVICES={count}."
            )
        devices = jax.devices()[:count]
        started = time.perf_counter()
        shapes = finetune_memory.abstract_batch(batch, length)
        sizes = finetune_memory.step_memory(cfg, shapes, devices)
        rows[name] = {
            "devices": len(devices),
            "batch": batch,
            **finetune_memory.held(cfg, devices),
            **sizes,
            "compile_seconds": round(time.perf_counter() - started, 1),
        }
    return rows


# ---- tables ------------------------------------------------------------------------------------


def _spread_cell(figures: dict[str, float], scale: float = 1.0, form: str = ",.0f") -> str:
    """`median (min-max)` of a `spread`, each times `scale`."""
    low, mid, high = (format(figures[k] * scale, form) for k in ("min", "median", "max"))
    return f"{mid} ({low}-{high})"


def print_tables(results: dict[str, Any], args: argparse.Namespace) -> None:
    if "product" in results:
        print(
            f"One mixture layer, forward and backward: {args.tokens} tokens, {args.top_k} of "
            f"{args.experts} experts, width {args.dim}, experts {args.expert_width} wide"
        )
        print("| product | ms per call | vs grouped | temporaries |\n|---|---|---|---|")
        for name, r in results["product"].items():
            milliseconds = _spread_cell(r["seconds"], 1e3, ".1f")
            print(
                f"| {name} | {milliseconds} | {r['vs_grouped']:.2f}x "
                f"| {r['temporaries'] / 2**20:.1f} MiB |"
            )
    if "training" in results:
        print(f"\nTraining, one device: depth {args.depth}, width {args.dim}, batch {args.batch}")
        print("| decoder | tokens/s | vs dense |\n|---|---|---|")
        for name, r in results["training"].items():
            print(f"| {name} | {_spread_cell(r['tokens_per_second'])} | {r['vs_dense']:.2f}x |")
    if "meshes" in results:
        print(f"\nTraining the default decoder, {args.experts} experts, on 8 devices, tensor=2")
        print("| mesh | tokens/s | vs data=4 |\n|---|---|---|")
        for name, r in results["meshes"].items():
            print(f"| {name} | {_spread_cell(r['tokens_per_second'])} | {r['vs_data=4']:.2f}x |")
    if "memory" in results:
        gib = 2**30
        print(f"\nQwen3-30B-A3B, {args.length} tokens a sequence, GiB per device (computed)")
        print("| case | batch | weights (all) | arguments | temporaries | peak |")
        print("|---|---|---|---|---|---|")
        for name, r in results["memory"].items():
            print(
                f"| {name} | {r['batch']} | {(r['base'] + r['adapters']) / gib:.1f} "
                f"| {r['arguments'] / gib:.1f} "
                f"| {r['temporaries'] / gib:.1f} | {r['peak'] / gib:.1f} |"
            )


SECTIONS = ("product", "training", "meshes", "memory")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=SECTIONS,
        default=list(SECTIONS),
        help="meshes needs 8 devices (on a CPU: JAX_NUM_CPU_DEVICES=8 in the environment)",
    )
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--expert-width", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="training steps per window")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--length", type=int, default=2048, help="tokens of the memory's batch")
    parser.add_argument(
        "--mesh-keys",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="meshes: the decoder's keys besides its defaults (e.g. model.dim=64)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"platform": jax.devices()[0].platform, "jax": jax.__version__}
    if "product" in args.sections:
        results["product"] = product_figures(args)
    if "training" in args.sections:
        results["training"] = training_figures(args)
    if "meshes" in args.sections:
        results["meshes"] = mesh_figures(args)
    if "memory" in args.sections:
        results["memory"] = memory_figures(QWEN3_30B_A3B, args.length)
    print_tables(results, args)
    print(json.dumps(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()

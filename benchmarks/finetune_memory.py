"""Memory of a QLoRA fine-tune of Qwen3-0.6B, 4B and 8B on one device, computed, not measured:
XLA's memory analysis of zoo's compiled train step (`compiled.memory_analysis()`) on the
abstract train state of each model (`jax.ShapeDtypeStruct`s: no weight is allocated, so an 8B
model's step compiles without an 8B model's memory).

    python -m benchmarks.finetune_memory --json runs/bench/finetune_memory.json

Each model is the published `config.json`'s architecture (`QWEN3`), read by zoo's qwen3 family
as `finetune.init_from=hf://Qwen/Qwen3-...` reads it, fine-tuned as docs/recipe-qwen3-chat.md
does: params in bfloat16 (`model.param_dtype=bf16`), LoRA of rank 16 on every attention and
MLP projection (`finetune.lora_layers=layers`) over nf4 codes (`finetune.quantize=nf4`), adamw;
a batch of `--batch` conversations padded to each of `--lengths` tokens (`data=chat`'s `tokens`,
`length` and `loss_mask`); `--remat` adds the same with `model.remat=true`. The step is the
trainer's own (`zoo.engine.steps.functions.make_steps` with its loss, trainable filter and optimizer),
made from the same config keys, and compiled for the backend this process runs on: XLA:CPU on a
machine without an accelerator, the GPU on a GPU machine (`JAX_PLATFORMS=cuda`).

What depends on the backend. The arguments (the train state: weights, adapters, the adapters'
Adam moments; and the batch) are the same everywhere. The temporaries are not: on a CPU, zoo's
attention (`zoo.engine.kernels.attention_cpu`) keeps each layer's batch x heads x length x
length logits for the backward pass, where on a CUDA GPU it runs cuDNN's flash attention, which
keeps none; and XLA:CPU's analysis shows no saving from `model.remat` (four of Qwen3-0.6B's
layers, a vocabulary of 1024, at 8 x 1024: 7.97 GiB of temporaries with it, 7.88 GiB without).
So a GPU's figures are expected to be lower than XLA:CPU's.

Prints one JSON line per step compiled, a table (GiB per device: the weights as held, the
adapters, the step's arguments, its temporaries, and its peak: arguments + outputs +
temporaries less what is updated in place), then one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from omegaconf import OmegaConf
from zoo.engine import registry
from zoo.engine.loop.build import build_model
from zoo.engine.report.memory import compiled_memory
from zoo.engine.sharding import mesh as sharding
from zoo.engine.sharding.abstract import eval_shape
from zoo.engine.sharding.plan import plan_state
from zoo.engine.steps import rngs
from zoo.engine.steps.functions import Trainable, make_steps
from zoo.engine.steps.optim import make_optimizer
from zoo.engine.steps.precision import compute_loss
from zoo.engine.weights import master
from zoo.engine.weights.freeze import frozen_filter, frozen_norms, trainable_filter

import zoo

_QWEN3_COMMON = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "head_dim": 128,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "hidden_act": "silu",
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "torch_dtype": "bfloat16",
}
QWEN3 = {
    "0.6B": {
        **_QWEN3_COMMON,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "max_window_layers": 28,
        "tie_word_embeddings": True,
    },
    "4B": {
        **_QWEN3_COMMON,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "max_window_layers": 36,
        "tie_word_embeddings": True,
    },
    "8B": {
        **_QWEN3_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "max_window_layers": 36,
        "tie_word_embeddings": False,
    },
}
"""The architecture keys of the `config.json` of `Qwen/Qwen3-0.6B`, `-4B` and `-8B` on the
Hugging Face Hub."""

FINETUNE = (
    "model.param_dtype=bf16",
    "finetune.lora_rank=16",
    "finetune.lora_layers=layers",
    "finetune.quantize=nf4",
)
"""The recipe's fine-tuning keys (docs/recipe-qwen3-chat.md)."""


def overrides(name: str, batch: int, remat: bool) -> list[str]:
    """The run's config keys: the model the checkpoint's config makes, as `finetune.init_from`
    sets them, and the recipe's."""
    (qwen3,) = [family for family in registry.families("decoder") if family.name == "qwen3"]
    hparams = qwen3.hparams(QWEN3[name])
    return [
        "model=decoder",
        "data=chat",
        *(f"model.{key}={json.dumps(value)}" for key, value in hparams.items()),
        *FINETUNE,
        f"model.remat={str(remat).lower()}",
        f"trainer.batch_size={batch}",
    ]


def abstract_batch(batch: int, length: int) -> dict[str, jax.ShapeDtypeStruct]:
    """`data=chat`'s columns for `batch` conversations padded to `length` targets."""
    return {
        "tokens": jax.ShapeDtypeStruct((batch, length + 1), jnp.int32),
        "length": jax.ShapeDtypeStruct((batch,), jnp.int32),
        "loss_mask": jax.ShapeDtypeStruct((batch, length), jnp.uint8),
    }


def step_memory(
    cfg: Any, batch: Mapping[str, jax.ShapeDtypeStruct], devices: Sequence[Any] | None = None
) -> dict[str, int]:
    """Bytes per device of the trainer's train step for `cfg` on `batch`, compiled on the
    abstract state: the model and its optimizer built by `zoo.engine.loop.build` under
    `eval_shape`, the step made as `zoo.engine.loop.trainer.Trainer` makes it, on `cfg.mesh`
    over `devices` (default: the first)."""
    entry = registry.get_model(cfg.model.name)
    hparams = OmegaConf.to_container(cfg.model)
    mesh, rules = sharding.mesh_and_rules(cfg.mesh, devices or jax.devices()[:1])
    frozen = frozen_filter(cfg.finetune)
    trainable = trainable_filter(cfg.finetune, frozen)
    tx, _ = make_optimizer(cfg.optimizer, cfg.trainer.steps)

    def create():
        model = build_model(entry, hparams, cfg.seed, cfg.finetune)
        return model, master.optimizer_for(model, tx, trainable)

    with sharding.activate(mesh, rules), nnx.use_eager_sharding(False):
        model, optimizer = eval_shape(create)
        graphdef, state = nnx.split((model, optimizer))
        placed(state, mesh, rules)
        step = Trainable(trainable, frozen_norms(model, trainable), cfg.trainer.grad_accum_steps)
        train = make_steps(graphdef, compute_loss(entry.loss, cfg.trainer.precision), step).train
        key = jax.eval_shape(lambda: rngs.step_key(cfg.seed))
        sums = jax.eval_shape(train, state, {}, batch, key)[1]
        return compiled_memory(train, state, sums, batch, key)


def placed(state: nnx.State, mesh: Any, rules: Any) -> None:
    """Give each array of the abstract `state` the sharding the trainer's plan gives it
    (`zoo.engine.sharding.plan`), in place: what each device holds of it."""
    plan = plan_state(state, mesh, rules)
    for (_, variable), row in zip(nnx.to_flat_state(state), plan.rows, strict=True):
        value = variable.get_value()
        where = jax.sharding.NamedSharding(mesh, row.spec)
        variable.set_value(jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=where))


def held(cfg: Any, devices: Sequence[Any] | None = None) -> dict[str, int]:
    """Bytes of the abstract model's params, all devices together: the base (codes and scales,
    norms, embedding) and the adapters; on `cfg.mesh` over `devices` (default: the first)."""
    entry = registry.get_model(cfg.model.name)
    hparams = OmegaConf.to_container(cfg.model)
    mesh, rules = sharding.mesh_and_rules(cfg.mesh, devices or jax.devices()[:1])
    with sharding.activate(mesh, rules), nnx.use_eager_sharding(False):
        model = eval_shape(lambda: build_model(entry, hparams, cfg.seed, cfg.finetune))
    sizes = {"adapters": 0, "base": 0}
    for _, variable in nnx.to_flat_state(nnx.state(model)):
        value = variable.get_value()
        nbytes = int(np.prod(value.shape)) * jnp.dtype(value.dtype).itemsize
        sizes["adapters" if isinstance(variable, nnx.LoRAParam) else "base"] += nbytes
    return sizes


def measure(name: str, batch: int, length: int, remat: bool) -> dict[str, Any]:
    cfg = zoo.compose(overrides(name, batch, remat))
    started = time.perf_counter()
    sizes = step_memory(cfg, abstract_batch(batch, length))
    return {
        "model": f"Qwen3-{name}",
        "batch": batch,
        "length": length,
        "remat": remat,
        **held(cfg),
        **sizes,
        "compile_seconds": round(time.perf_counter() - started, 1),
    }


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    gib = 2**30
    columns = "model | batch x tokens | remat | weights (nf4 + bf16) | adapters | arguments"
    lines = [f"| {columns} | temporaries | peak |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['batch']} x {r['length']} | {'yes' if r['remat'] else 'no'} | "
            f"{r['base'] / gib:.2f} GiB | {r['adapters'] / 2**20:.1f} MiB | "
            f"{r['arguments'] / gib:.2f} GiB | {r['temporaries'] / gib:.2f} GiB | "
            f"{r['peak'] / gib:.2f} GiB |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(QWEN3), default=list(QWEN3))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--remat", action="store_true", help="also with model.remat=true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    remats = [False, True] if args.remat else [False]
    rows = []
    for name in args.models:
        for length in args.lengths:
            for remat in remats:
                rows.append(measure(name, args.batch, length, remat))
                print(json.dumps(rows[-1]), flush=True)
    platform = jax.devices()[0].platform
    print(f"Computed, not measured (XLA's memory analysis, {platform} backend), per device:")
    print(table(rows))
    results = {"platform": platform, "jax": jax.__version__, "rows": rows}
    print(json.dumps(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

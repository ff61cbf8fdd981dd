"""QLoRA over a mixture's experts: the bytes each format holds of the experts' kernels.

    python -m benchmarks.experts_qlora

- **fixture**: the stacked expert kernels of the tiny Qwen3-MoE fixture
  (`tests/fixtures/pretrained/qwen3-moe-tiny`: 2 mixture layers of 4 experts, width 32, each
  expert 24 wide) in bfloat16, and quantized from them as a QLoRA fine-tune holds them
  (`finetune.quantize=int8|int4|nf4|mxfp4`): codes and scales, computed. Its widths are not
  multiples of 64, so each (expert, output) row has one scale.
- **qwen3-30b-a3b**: the same figures for the experts of Qwen3-30B-A3B's architecture (its hub
  config, `benchmarks.experts.QWEN3_30B_A3B`: 48 layers of 128 experts, width 2048, each expert
  768 wide), from the shapes alone (`jax.eval_shape`): one scale per 64 inputs.

Prints one table: bytes per format and their ratio to bfloat16's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from zoo.engine.weights.quantize import FORMATS, Layout, quantize

import zoo
from benchmarks.experts import QWEN3_30B_A3B

FIXTURE = "tests/fixtures/pretrained/qwen3-moe-tiny"


def held_bytes(kernels: list[jax.Array | jax.ShapeDtypeStruct]) -> dict[str, int]:
    """Bytes of `kernels` (bfloat16, [experts, out, in]) as they are and as each format's
    codes and scales, quantized along the last axis."""
    found = {"bf16": sum(k.size * 2 for k in kernels)}
    for qtype in FORMATS:
        total = 0
        for kernel in kernels:
            layout = Layout(tuple(kernel.shape), jnp.dtype(jnp.bfloat16), 2, qtype)
            quantized = (
                quantize(kernel, layout)
                if isinstance(kernel, jax.Array)
                else jax.eval_shape(quantize, kernel, layout)
            )
            total += sum(part.size * part.dtype.itemsize for part in quantized)
        found[qtype] = total
    return found


def fixture_kernels() -> list[jax.Array]:
    """The fixture's expert kernels, in bfloat16."""
    state = nnx.to_flat_state(nnx.state(zoo.load(FIXTURE).model, nnx.Param))
    return [
        jnp.asarray(np.asarray(v[...]), jnp.bfloat16)
        for path, v in state
        if "experts" in map(str, path)
    ]


def qwen3_30b_kernels() -> list[jax.ShapeDtypeStruct]:
    """The shapes of Qwen3-30B-A3B's expert kernels: gate, up and down of every layer."""
    config = QWEN3_30B_A3B
    experts, dim = config["num_experts"], config["hidden_size"]
    hidden = config["moe_intermediate_size"]
    shapes = [(experts, hidden, dim)] * 2 + [(experts, dim, hidden)]
    layers = config["num_hidden_layers"]
    return [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes] * layers


def main() -> None:
    rows = {
        "fixture": held_bytes(fixture_kernels()),
        "qwen3-30b-a3b": held_bytes(qwen3_30b_kernels()),
    }
    print("| experts of | " + " | ".join(rows["fixture"]) + " |")
    print("|---" * (len(rows["fixture"]) + 1) + "|")
    for name, found in rows.items():
        cells = [f"{b:,} B ({b / found['bf16']:.2f}x)" for b in found.values()]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

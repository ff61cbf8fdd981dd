"""How close each checkpoint family's fixture comes to the reference implementation's own outputs:
the largest absolute difference between the logits of the model `zoo.load` gives and those
transformers / PyTorch computed for the same inputs (`tests/fixtures/pretrained/*/reference.npz`,
written by the committed `tests/fixtures/pretrained/make_*.py`), on one device and on the
(2, 2, 2) mesh of 8 simulated CPU devices, in float32 at the highest matmul precision.

    python -m benchmarks.parity --json runs/bench/parity.json

The tests hold every fixture to 1e-5; this prints the figures themselves, for the manual's
table of checkpoint families.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax
import numpy as np
from flax import nnx
from zoo.engine.weights import pretrained as weights

import zoo

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "pretrained"
MESHES = {"1 device": {"data": 1, "fsdp": 1, "tensor": 1}, "2x2x2 mesh": None}
INPUTS = {"logits": ("tokens", "images"), "large_logits": ("large_images",)}
"""Each reference output, and the input it was computed from (the first one the file has). The
grayscale references of the timm ResNets need the checkpoint built for one input channel, which
`zoo.load` of the directory does not do: the suite checks those (at 1e-5)."""


def cases(reference: dict[str, np.ndarray]):
    """(name, inputs, expected logits) of every input set a fixture's reference holds."""
    for output, names in INPUTS.items():
        for name in names:
            if output in reference and name in reference:
                yield name, reference[name], reference[output]


@nnx.jit
def forward(model: nnx.Module, inputs: jax.Array) -> jax.Array:
    return model(inputs)


def max_differences(directory: Path) -> dict[str, dict[str, float]]:
    with np.load(directory / "reference.npz") as npz:
        reference = dict(npz)
    figures: dict[str, dict[str, float]] = {}
    for mesh_name, mesh in MESHES.items():
        sizes = mesh or {"data": 2, "fsdp": 2, "tensor": 2}
        devices = jax.devices()[: int(np.prod(list(sizes.values())))]
        model = zoo.load(directory, mesh=sizes, devices=devices)
        with model.activate(), jax.default_matmul_precision("highest"):
            for name, inputs, expected in cases(reference):
                # The batch repeated up to a multiple of 8, so the mesh's batch axes divide it.
                padded = np.concatenate([inputs] * (8 // np.gcd(len(inputs), 8)))
                logits = np.asarray(forward(model.model, padded), np.float64)[: len(inputs)]
                logits = logits[..., : expected.shape[-1]]  # gpt's vocabulary padded to shard
                figures.setdefault(name, {})[mesh_name] = float(np.abs(logits - expected).max())
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    report = {}
    print(f"{'fixture':24} {'inputs':14} " + " ".join(f"{m:>12}" for m in MESHES))
    for directory in sorted(p.parent for p in FIXTURES.glob("*/reference.npz")):
        family = weights.open_pretrained(directory).family
        report[directory.name] = {"family": family.name, "max_abs_diff": max_differences(directory)}
        for name, by_mesh in report[directory.name]["max_abs_diff"].items():
            print(
                f"{directory.name:24} {name:14} " + " ".join(f"{by_mesh[m]:12.2e}" for m in MESHES)
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

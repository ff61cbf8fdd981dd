"""Every tiny model's default run, hashed: the SHA-256 of the bytes of its final state (model
and optimizer, as the checkpoints hold it), on one device and on the 2x2x2 mesh of 8 devices.

A refactor that must not change a float32 bit is checked by running this before and after it
and comparing the two JSON files:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python -m benchmarks.state_hashes --out before.json
    ... change ...
    python -m benchmarks.state_hashes --out after.json --against before.json

The run is the conformance suite's (20 steps of Adam at batch 16 on each model's `tiny`
configuration); `--models` narrows it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile

MESHES = {"one device": (1, 1, 1), "2x2x2": (2, 2, 2)}
_MESH = os.environ.get("ZOO_STATE_HASH_MESH")
if _MESH:  # a child process: as many simulated devices as its mesh has, before jax starts
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={math.prod(MESHES[_MESH])}"

import jax
import numpy as np
from flax import nnx

import zoo

TRAINING = (
    "trainer.steps=20",
    "trainer.batch_size=16",
    "trainer.log_every=20",
    "logging.norms_every=0",
    "trainer.steps_per_dispatch=1",
    "optimizer.name=adam",
    "optimizer.learning_rate=0.01",
    "optimizer.schedule=constant",
    "optimizer.warmup_steps=0",
)
"""A few steps of Adam at a rate that moves a tiny model, no norms sampled: the run the
conformance suite trains every model with (tests/conformance/test_conformance_runs.py)."""


def state_hash(state: nnx.State) -> str:
    """SHA-256 over every leaf's path, dtype, shape and bytes, in path order."""
    digest = hashlib.sha256()
    for path, leaf in sorted(
        jax.tree_util.tree_flatten_with_path(state)[0], key=lambda x: str(x[0])
    ):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        value = np.asarray(jax.device_get(leaf))
        digest.update(f"{jax.tree_util.keystr(path)}|{value.dtype}|{value.shape}".encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()


def tiny_models() -> list[str]:
    return [name for name in zoo.list_models() if zoo.get_model(name).tiny]


def run_hash(name: str, mesh: tuple[int, int, int], workdir: str) -> str:
    sizes = dict(zip(("data", "fsdp", "tensor"), mesh, strict=True))
    result = zoo.fit(
        name,
        *zoo.get_model(name).tiny,
        *TRAINING,
        *(f"mesh.{axis}={size}" for axis, size in sizes.items()),
        f"workdir={workdir}",
    )
    return state_hash(result.state)


def child(models: list[str]) -> None:
    """The runs on this process's mesh (`$ZOO_STATE_HASH_MESH`), one JSON line each."""
    label = _MESH
    for name in models or tiny_models():
        with tempfile.TemporaryDirectory() as workdir:
            value = run_hash(name, MESHES[label], workdir)
        print(json.dumps([name, label, value]), flush=True)


def on_each_mesh(models: list[str]) -> dict[str, dict[str, str]]:
    hashes: dict[str, dict[str, str]] = {}
    for label in MESHES:
        command = [sys.executable, "-m", "benchmarks.state_hashes", "--models", *models]
        env = {**os.environ, "ZOO_STATE_HASH_MESH": label, "JAX_PLATFORMS": "cpu"}
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode:
            raise SystemExit(f"the runs on {label} failed:\n{done.stderr[-4000:]}")
        for line in done.stdout.splitlines():
            if line.startswith("["):
                name, _, value = json.loads(line)
                hashes.setdefault(name, {})[label] = value
                print(f"{name:14s} {label:10s} {value[:16]}", flush=True)
    return hashes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=[], help="default: every tiny model")
    parser.add_argument("--out", default=None, help="write the hashes here as JSON")
    parser.add_argument("--against", default=None, help="a JSON of hashes to compare with")
    args = parser.parse_args(argv)
    if _MESH:
        child(args.models)
        return 0
    hashes = on_each_mesh(args.models)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(hashes, f, indent=1, sort_keys=True)
    if args.against:
        with open(args.against) as f:
            before = json.load(f)
        changed = [
            f"{name} ({label})"
            for name, labels in hashes.items()
            for label, value in labels.items()
            if before.get(name, {}).get(label) != value
        ]
        print("same bits" if not changed else f"changed: {', '.join(changed)}")
        return 1 if changed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

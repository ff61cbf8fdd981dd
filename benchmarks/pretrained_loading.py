"""What loading a pretrained checkpoint costs: `zoo.load(DIR)` of a GPT-2-small-sized checkpoint
(124M params: vocabulary 50,257, context 1,024, 12 layers, 768 wide; random weights made here
with numpy and safetensors) against reading its safetensors file into numpy arrays.

    python -m benchmarks.pretrained_loading --repeats 3 --json runs/bench/pretrained.json

Each measurement runs in a fresh interpreter: its wall time (from after the imports to the
last param on its devices) and its peak host memory (`ru_maxrss`) less that of an interpreter
that imported the same libraries and did nothing else. zoo loads onto 1 device and onto 8
(simulated CPU devices, `mesh.fsdp=8`: each device holds an eighth of every sharded param; a
data-parallel mesh would hold a full copy per device by definition). Goals: at most 1.5x the
time of the numpy read, and a peak of at most 1.5x the file size. Medians over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

VOCAB, CONTEXT, DEPTH, WIDTH = 50257, 1024, 12, 768
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "zoo-bench" / "gpt2-small"
WEIGHTS = "model.safetensors"
MESHES = {1: None, 8: {"data": 1, "fsdp": 8}}
"""zoo's mesh on 1 and on 8 devices."""
NUMPY = "numpy read (safetensors.numpy.load_file)"
CASES = {
    NUMPY: ("numpy", 1),
    "zoo fill, 1 device": ("fill", 1),
    "zoo fill, 8 devices (fsdp=8)": ("fill", 8),
    "zoo.load, 1 device": ("zoo", 1),
    "zoo.load, 8 devices (fsdp=8)": ("zoo", 8),
}
"""`fill`: the weights read and placed on the planned model (the loading itself, into host pages
that were faulted in while it was planned); `zoo`: `zoo.load` whole, with Hydra's composition
and the abstract model's trace besides."""


def gpt2_small_shapes():
    """(key, shape) of every tensor of a GPT-2-small `GPT2Model` checkpoint."""
    yield "wte.weight", (VOCAB, WIDTH)
    yield "wpe.weight", (CONTEXT, WIDTH)
    for i in range(DEPTH):
        for name, shape in [
            ("ln_1.weight", (WIDTH,)),
            ("ln_1.bias", (WIDTH,)),
            ("attn.c_attn.weight", (WIDTH, 3 * WIDTH)),
            ("attn.c_attn.bias", (3 * WIDTH,)),
            ("attn.c_proj.weight", (WIDTH, WIDTH)),
            ("attn.c_proj.bias", (WIDTH,)),
            ("ln_2.weight", (WIDTH,)),
            ("ln_2.bias", (WIDTH,)),
            ("mlp.c_fc.weight", (WIDTH, 4 * WIDTH)),
            ("mlp.c_fc.bias", (4 * WIDTH,)),
            ("mlp.c_proj.weight", (4 * WIDTH, WIDTH)),
            ("mlp.c_proj.bias", (WIDTH,)),
        ]:
            yield f"h.{i}.{name}", shape
    yield "ln_f.weight", (WIDTH,)
    yield "ln_f.bias", (WIDTH,)


def make_checkpoint(directory: Path) -> Path:
    """The random GPT-2-small checkpoint in `directory`, written once and reused."""
    from safetensors.numpy import save_file

    if (directory / WEIGHTS).is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    tensors = {
        key: (0.02 * rng.standard_normal(shape, np.float32)).astype(np.float32)
        for key, shape in gpt2_small_shapes()
    }
    config = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": VOCAB,
        "n_positions": CONTEXT,
        "n_embd": WIDTH,
        "n_layer": DEPTH,
        "n_head": 12,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(directory / f"{WEIGHTS}.partial"), metadata={"format": "pt"})
    os.replace(directory / f"{WEIGHTS}.partial", directory / WEIGHTS)
    return directory


def measure(what: str, directory: str, devices: int) -> dict[str, float]:
    """In this (fresh) interpreter: seconds and peak resident bytes of `what`."""
    import jax
    from safetensors.numpy import load_file

    import zoo
    from zoo.api import plan_pretrained

    jax.devices()  # the backend is up before the clock starts
    started = time.perf_counter()
    if what == "numpy":
        arrays = load_file(os.path.join(directory, WEIGHTS))
        count = sum(a.size for a in arrays.values())
    elif what == "zoo":
        loaded = zoo.load(directory, mesh=MESHES[devices], devices=jax.devices()[:devices])
        count = _placed_elements(loaded.model)
    elif what == "fill":  # config, mesh and abstract model made before the clock starts
        planned = plan_pretrained(directory, MESHES[devices], jax.devices()[:devices])
        started = time.perf_counter()
        count = _placed_elements(planned.fill())
    else:  # baseline: the same imports, nothing loaded
        count = 0
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "peak_bytes": peak, "elements": count}


def _placed_elements(model) -> int:
    import jax
    from flax import nnx

    leaves = jax.tree.leaves(nnx.state(model))
    jax.block_until_ready(leaves)
    return sum(x.size for x in leaves)


def in_fresh_process(what: str, directory: Path, devices: int) -> dict[str, float]:
    env = {**os.environ, "JAX_NUM_CPU_DEVICES": str(devices), "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "benchmarks.pretrained_loading", "--measure", what]
    command += ["--dir", str(directory), "--devices", str(devices)]
    out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def run(directory: Path, repeats: int) -> dict:
    """Each case `repeats` times, the cases interleaved (round after round), so that a load on
    the machine that comes and goes weighs on each alike."""
    size = (directory / WEIGHTS).stat().st_size
    results = {"file_bytes": size, "params": int(sum(np.prod(s) for _, s in gpt2_small_shapes()))}
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in CASES}
    for _ in range(repeats):
        for name, (what, devices) in CASES.items():
            base = in_fresh_process("baseline", directory, devices)
            got = in_fresh_process(what, directory, devices)
            runs[name].append((got["seconds"], got["peak_bytes"] - base["peak_bytes"]))
    for name, measured in runs.items():
        seconds = statistics.median(r[0] for r in measured)
        peak = statistics.median(r[1] for r in measured)
        results[name] = {"seconds": seconds, "peak_bytes": peak, "peak_x_file": peak / size}
        print(f"  {name}: {seconds:.2f} s, peak {peak / 2**20:.0f} MiB", flush=True)
    for name in CASES:
        results[name]["time_x_numpy"] = results[name]["seconds"] / results[NUMPY]["seconds"]
    return results


def table(results: dict) -> str:
    lines = [
        (
            f"GPT-2-small-sized checkpoint: {results['params']:,} params, "
            f"{results['file_bytes'] / 2**20:.0f} MiB of float32"
        ),
        "",
        "| load | wall time | x numpy read | peak host memory | x file size |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if not isinstance(r, dict):
            continue
        lines.append(
            f"| {name} | {r['seconds']:.2f} s | {r['time_x_numpy']:.2f} | "
            f"{r['peak_bytes'] / 2**20:.0f} MiB | {r['peak_x_file']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=CACHE, help="where the checkpoint is kept")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--measure", choices=["baseline", "numpy", "zoo", "fill"], help=argparse.SUPPRESS
    )
    parser.add_argument("--dir", help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.dir, args.devices)))
        return
    directory = make_checkpoint(args.cache)
    results = run(directory, args.repeats)
    print(table(results))
    print(json.dumps(results, indent=2, default=float))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=float))


if __name__ == "__main__":
    main()

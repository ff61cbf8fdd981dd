"""What loading a pretrained checkpoint costs: `zoo.load(DIR)` of a GPT-2-small-sized checkpoint
(124M params: vocabulary 50,257, context 1,024, 12 layers, 768 wide; random weights made here
with numpy and safetensors) against reading its safetensors file into numpy arrays.

    python -m benchmarks.pretrained_loading --repeats 3 --json runs/bench/pretrained.json
    python -m benchmarks.pretrained_loading --size medium   # GPT-2 medium: 355M, 24 x 1,024

Each measurement runs in a fresh interpreter: its wall time (from after the imports to the
last param on its devices) and its peak host memory (`VmHWM`) less that of an interpreter
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

VOCAB, CONTEXT = 50257, 1024
SIZES = {"small": (12, 768, 12), "medium": (24, 1024, 16)}
"""GPT-2's sizes: layers, width, heads."""
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "zoo-bench"
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
faulted in before the clock starts); `zoo`: `zoo.load` whole, with Hydra's composition
and the abstract model's trace besides."""


def gpt2_shapes(size: str):
    """(key, shape) of every tensor of a GPT-2 `GPT2Model` checkpoint of `size`."""
    depth, width, _ = SIZES[size]
    yield "wte.weight", (VOCAB, width)
    yield "wpe.weight", (CONTEXT, width)
    for i in range(depth):
        for name, shape in [
            ("ln_1.weight", (width,)),
            ("ln_1.bias", (width,)),
            ("attn.c_attn.weight", (width, 3 * width)),
            ("attn.c_attn.bias", (3 * width,)),
            ("attn.c_proj.weight", (width, width)),
            ("attn.c_proj.bias", (width,)),
            ("ln_2.weight", (width,)),
            ("ln_2.bias", (width,)),
            ("mlp.c_fc.weight", (width, 4 * width)),
            ("mlp.c_fc.bias", (4 * width,)),
            ("mlp.c_proj.weight", (4 * width, width)),
            ("mlp.c_proj.bias", (width,)),
        ]:
            yield f"h.{i}.{name}", shape
    yield "ln_f.weight", (width,)
    yield "ln_f.bias", (width,)


def make_checkpoint(directory: Path, size: str) -> Path:
    """The random GPT-2 checkpoint of `size` in `directory`, written once and reused."""
    from safetensors.numpy import save_file

    if (directory / WEIGHTS).is_file():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    tensors = {
        key: (0.02 * rng.standard_normal(shape, np.float32)).astype(np.float32)
        for key, shape in gpt2_shapes(size)
    }
    depth, width, heads = SIZES[size]
    config = {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": VOCAB,
        "n_positions": CONTEXT,
        "n_embd": width,
        "n_layer": depth,
        "n_head": heads,
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
    from zoo.engine.weights.pretrained import open_pretrained

    import zoo
    from zoo.loading import checkpoint_hparams, plan_pretrained

    jax.devices()  # the backend is up before the clock starts
    started = time.perf_counter()
    if what == "numpy":
        arrays = load_file(os.path.join(directory, WEIGHTS))
        count = sum(a.size for a in arrays.values())
    elif what == "zoo":
        loaded = zoo.load(directory, mesh=MESHES[devices], devices=jax.devices()[:devices])
        count = _placed_elements(loaded.model)
    elif what == "fill":  # config, mesh and abstract model made before the clock starts
        pretrained = open_pretrained(directory)
        hparams = checkpoint_hparams(pretrained)
        planned = plan_pretrained(pretrained, hparams, MESHES[devices], jax.devices()[:devices])
        planned.memory.wait()
        started = time.perf_counter()
        count = _placed_elements(planned.fill())
    else:  # baseline: the same imports, nothing loaded
        count = 0
    seconds = time.perf_counter() - started
    peak = peak_resident_bytes()
    return {"seconds": seconds, "peak_bytes": peak, "elements": count}


def peak_resident_bytes() -> int:
    """This process's peak resident memory: Linux's `VmHWM`, the high-water mark of this
    program's own pages (`ru_maxrss` also keeps that of the process it was forked from, which
    made a child of the process that had just written the checkpoint look 1 GB larger)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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


def run(directory: Path, size: str, repeats: int) -> dict:
    """Each case `repeats` times, the cases interleaved (round after round), so that a load on
    the machine that comes and goes weighs on each alike."""
    file_bytes = (directory / WEIGHTS).stat().st_size
    params = int(sum(np.prod(s) for _, s in gpt2_shapes(size)))
    results = {"size": size, "file_bytes": file_bytes, "params": params}
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in CASES}
    for _ in range(repeats):
        for name, (what, devices) in CASES.items():
            base = in_fresh_process("baseline", directory, devices)
            got = in_fresh_process(what, directory, devices)
            runs[name].append((got["seconds"], got["peak_bytes"] - base["peak_bytes"]))
    for name, measured in runs.items():
        seconds = statistics.median(r[0] for r in measured)
        peak = statistics.median(r[1] for r in measured)
        results[name] = {"seconds": seconds, "peak_bytes": peak, "peak_x_file": peak / file_bytes}
        print(f"  {name}: {seconds:.2f} s, peak {peak / 2**20:.0f} MiB", flush=True)
    for name in CASES:
        results[name]["time_x_numpy"] = results[name]["seconds"] / results[NUMPY]["seconds"]
    return results


def table(results: dict) -> str:
    lines = [
        (
            f"GPT-2-{results['size']}-sized checkpoint: {results['params']:,} params, "
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
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--cache", type=Path, default=CACHE, help="where checkpoints are kept")
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
    directory = make_checkpoint(args.cache / f"gpt2-{args.size}", args.size)
    results = run(directory, args.size, args.repeats)
    print(table(results))
    print(json.dumps(results, indent=2, default=float))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=float))


if __name__ == "__main__":
    main()

"""Shared helpers: running the CLI in a real subprocess, reading TensorBoard events back,
comparing states bit for bit."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parent.parent
TINY_TEXT = ROOT / "tests" / "fixtures" / "pretrained" / "tiny.txt"
TINY_TEXT_FINETUNE = (
    f"data.path={TINY_TEXT}",
    "data.window=16",
    "trainer.steps=3",
    "trainer.batch_size=8",
    "trainer.eval_every=3",
    "optimizer.warmup_steps=0",
    "optimizer.schedule=constant",
    "optimizer.learning_rate=1e-2",
    "logging.norms_every=0",  # no norms at the first step: a gradient's compilation less
    "logging.eval_reports=false",  # no sampled text at the evals: the tests read no samples
)
"""A three-step fine-tune on the tiny text, which the pretrained fine-tuning tests share."""
TWO_LOGGED_STEPS = (
    "trainer.steps=2",
    "trainer.batch_size=8",
    "trainer.log_every=1",
    "trainer.eval_every=2",
)
"""Two steps of 8 rows, each logged, and an eval after the second: the fine-tunes whose tests
read TensorBoard step by step."""
# The environment of a process whose compilations are counted: without the session's cache.
NO_COMPILE_CACHE = {"JAX_ENABLE_COMPILATION_CACHE": "false"}


def run_module(
    module: str,
    *args,
    env: dict[str, str | None] | None = None,
    timeout: float = 300,
    cwd=ROOT,
    devices: int = 1,
) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` from the repository root (or `cwd`), as a user would run it, on
    `devices` simulated devices; `env` entries set to None are removed from the environment.

    One device unless the test is about meshes: a command line's run compiles and steps about
    30% faster on one (the suite starts a few hundred), and the meshes have tests of their own,
    in process and on the command line (`devices=8`)."""
    merged = {**os.environ, "JAX_NUM_CPU_DEVICES": str(devices), **(env or {})}
    full_env = {key: value for key, value in merged.items() if value is not None}
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        cwd=cwd,
        env=full_env,
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_cli(*args, **options) -> subprocess.CompletedProcess:
    """`python -m zoo.train ARGS` (`run_module`, with its options)."""
    return run_module("zoo.train", *args, **options)


def generate_cli(*args, **options) -> subprocess.CompletedProcess:
    """`python -m zoo.generate ARGS` (`run_module`, with its options)."""
    return run_module("zoo.generate", *args, **options)


def export_cli(*args, **options) -> subprocess.CompletedProcess:
    """`python -m zoo.export ARGS` (`run_module`, with its options)."""
    return run_module("zoo.export", *args, **options)


def read_events(workdir: str | os.PathLike) -> EventAccumulator:
    files = glob.glob(os.path.join(workdir, "events.out.tfevents.*"))
    assert files, f"no TensorBoard event file in {workdir}"
    accumulator = EventAccumulator(str(workdir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def scalar_steps(events: EventAccumulator, tag: str) -> dict[int, float]:
    return {event.step: event.value for event in events.Scalars(tag)}


def assert_same_bits(a, b) -> None:
    def raw(x):
        return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x

    paths_a, paths_b = jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)
    assert len(paths_a) == len(paths_b) > 0
    for (path, x), (_, y) in zip(paths_a, paths_b, strict=True):
        np.testing.assert_array_equal(np.asarray(raw(x)), np.asarray(raw(y)), err_msg=str(path))


def run_and_signal(
    args: list[str], workdir, kill_after: int, signum: int, total: int, env: dict | None = None
):
    """Start `python -m zoo.train ARGS`, wait until its train.log shows that step `kill_after`
    of `total` is done (each window's line is logged once the next window closes), then send
    `signum`; returns (exit code, stderr)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "zoo.train", *args],
        cwd=ROOT,
        env={**os.environ, "JAX_NUM_CPU_DEVICES": "8", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    log, marker = Path(workdir) / "train.log", f"] step {kill_after}/{total} "
    while process.poll() is None:
        if log.exists() and marker in log.read_text():
            process.send_signal(signum)
            break
        time.sleep(0.002)
    _, stderr = process.communicate(timeout=300)
    return process.returncode, stderr


def one_step(trainer):
    """Loss and grads of a trainer's first training step (its own grad step), on the host."""
    from zoo.engine.sharding import mesh as sharding

    batch = next(iter(trainer.train_data))
    with sharding.activate(trainer.mesh, trainer.rules):
        loss, grads = trainer.jitted.grad(trainer.state, trainer.shard(batch), trainer.step_key)
    return float(loss), jax.device_get(jax.tree.leaves(grads))


def overriding(*overrides: str) -> list[str]:
    """`overrides` with each key once, its last value winning, so a test can set a value over
    a base list (the command line refuses a key typed twice)."""
    merged: dict[str, str] = {}
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        merged.pop(key, None)
        merged[key] = override
    return list(merged.values())


def write_jsonl(path: Path, rows: list) -> Path:
    """`rows` as a JSON Lines file at `path` (its folders made), as users write them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@contextlib.contextmanager
def running(app, api_key: str = "unused") -> Iterator:
    """An `openai` client of `app` (a `zoo.serve` application), served in a thread on a free
    port of 127.0.0.1 until the block ends (no retries: a 429 is seen as it is)."""
    import openai
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    started = threading.Event()
    while not started.wait(0.05):
        if server.started:
            started.set()
    try:
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key, max_retries=0)
    finally:
        server.should_exit = True
        thread.join()

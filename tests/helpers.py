"""Shared helpers: running the CLI in a real subprocess, reading TensorBoard events back."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str, env: dict[str, str | None] | None = None, timeout: float = 300):
    """`python -m zoo.train ARGS` from the repository root, as a user would run it; `env`
    entries set to None are removed from the environment."""
    merged = {**os.environ, "JAX_NUM_CPU_DEVICES": "8", **(env or {})}
    full_env = {key: value for key, value in merged.items() if value is not None}
    return subprocess.run(
        [sys.executable, "-m", "zoo.train", *args],
        cwd=ROOT,
        env=full_env,
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_events(workdir: str | os.PathLike) -> EventAccumulator:
    files = glob.glob(os.path.join(workdir, "events.out.tfevents.*"))
    assert files, f"no TensorBoard event file in {workdir}"
    accumulator = EventAccumulator(str(workdir), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def scalar_steps(events: EventAccumulator, tag: str) -> dict[int, float]:
    return {event.step: event.value for event in events.Scalars(tag)}

"""Whole commands in fresh processes, and the figures a training run leaves in its `train.log`.

A run's `train.log` holds every log line of the run, each stamped with the local time to the
millisecond: the trainer's timing lines (logger `train.timing`: the first dispatch, each
checkpoint's blocking seconds, each restore), the "N parameters" line, the final eval, and with
`JAX_LOG_COMPILES=1` JAX's "Compiling jit(f) ..." and "Finished XLA compilation of jit(f)" lines
(which reach the console's stderr too).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RETRIES = 2
ABORTED: list[str] = []
"""The commands of the attempts that XLA:CPU aborted, each run again (up to `RETRIES` times):
with several simulated devices on 2 cores, now and then one device never reaches an all-reduce
and XLA:CPU ends the process after its rendezvous timeout (40 s), with or without the test
suite's XLA flags (tests/conftest.py)."""
_WEDGED = "Termination timeout for `"

_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")
_FIRST_DISPATCH = "[train.timing][INFO] First dispatch of this run"
_SETUP_DONE = re.compile(r"\[zoo\]\[INFO\] (?:Resuming at step \d+: t|T)raining ")
_PARAMETERS = re.compile(r"; ([\d,]+) parameters; ")
_SAVE = re.compile(r"\[train\.timing\]\[INFO\] Checkpoint (\d+): ([\d.]+) s blocking")
_RESTORE = re.compile(r"\[train\.timing\]\[INFO\] Restored step (\d+) from .* in ([\d.]+) s")
_FINAL_EVAL = re.compile(r"\[zoo\]\[INFO\] Final eval @ step \d+: (.*)")
_COMPILING = re.compile(r"Compiling jit\((.+?)\) with global shapes and types (.*?)\. Argument")
_COMPILED = re.compile(r"Finished XLA compilation of jit\((.+?)\) in ([\d.]+) sec")


@dataclasses.dataclass
class Run:
    """One finished command: when it was launched (epoch seconds), how long it took, what it
    printed."""

    launched: float
    seconds: float
    stdout: str
    stderr: str


def run(
    command: Sequence[str],
    env: Mapping[str, str] | None = None,
    before_retry: Callable[[], None] = lambda: None,
    timeout: float = 600,
) -> Run:
    """`command` from the repository root in a fresh process, with `env` added to this process's
    environment, run again (after `before_retry()`) if XLA:CPU aborts it on a stuck collective;
    raises if it fails otherwise."""
    attempts = 0
    while True:
        launched, start = time.time(), time.perf_counter()
        done = subprocess.run(
            command,
            check=False,  # a failure is raised below, with its stderr
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        seconds = time.perf_counter() - start
        if done.returncode and _WEDGED in done.stderr and attempts < RETRIES:
            attempts += 1
            ABORTED.append(" ".join(command))
            before_retry()
            continue
        if done.returncode:
            message = f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-4000:]}"
            raise RuntimeError(message)
        return Run(launched, seconds, done.stdout, done.stderr)


def device_env(devices: int) -> dict[str, str]:
    return {"JAX_NUM_CPU_DEVICES": str(devices)}


def train(
    overrides: Sequence[str],
    workdir: Path,
    devices: int = 1,
    env: Mapping[str, str] | None = None,
) -> tuple[Run, str]:
    """`python -m zoo.train OVERRIDES workdir=WORKDIR` on `devices` CPU devices, with `env`
    added: the run and the text of its train.log (a resumed run's log holds the earlier runs'
    lines too: only the lines after this launch are returned). An aborted attempt's checkpoints
    are removed before the next, so the run starts from the same checkpoints again."""
    command = [sys.executable, "-m", "zoo.train", *overrides, f"workdir={workdir}"]
    checkpoints = workdir / "checkpoints"
    earlier = set(os.listdir(checkpoints)) if checkpoints.is_dir() else set()

    def forget_attempt() -> None:
        for path in checkpoints.iterdir() if checkpoints.is_dir() else ():
            if path.name not in earlier:
                shutil.rmtree(path)

    done = run(command, {**device_env(devices), **(env or {})}, forget_attempt)
    own, keep = [], False
    for line in (workdir / "train.log").read_text().splitlines():
        stamp = stamp_of(line)
        if stamp is not None:  # a continuation line goes with the line it continues
            keep = stamp >= done.launched - 0.001  # the stamps are truncated to milliseconds
        if keep:
            own.append(line)
    return done, "\n".join(own)


def stamp_of(line: str) -> float | None:
    """The epoch seconds of a log line's local-time stamp; None for a continuation line."""
    match = _STAMP.match(line)
    if match is None:
        return None
    return datetime.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _stamp_of_first(log: str, found) -> float:
    for line in log.splitlines():
        if found(line):
            return stamp_of(line)
    raise ValueError("no such line in train.log")


def first_dispatch(log: str) -> float:
    """When the run's first step was dispatched (compiled and running)."""
    return _stamp_of_first(log, lambda line: _FIRST_DISPATCH in line)


def setup_done(log: str) -> float:
    """When the run was set up (data, model, optimizer, restored state) and starts its loop."""
    return _stamp_of_first(log, lambda line: _SETUP_DONE.search(line) is not None)


def parameters(log: str) -> int:
    return int(_PARAMETERS.search(log)[1].replace(",", ""))


def checkpoint_saves(log: str) -> dict[int, float]:
    """Step -> seconds that the loop was blocked by the save of that step's checkpoint."""
    return {int(step): float(s) for step, s in _SAVE.findall(log)}


def restores(log: str) -> dict[int, float]:
    """Step -> seconds that restoring that step's checkpoint took."""
    return {int(step): float(s) for step, s in _RESTORE.findall(log)}


def final_eval(log: str) -> dict[str, float]:
    words = _FINAL_EVAL.search(log)[1].split()
    return {name: float(value) for name, value in zip(words[::2], words[1::2], strict=True)}


def compilations(log: str) -> dict[str, dict[str, float]]:
    """Per jitted function: how many times it was compiled, for how many distinct signatures
    (the argument shapes and dtypes, with the mesh axes that shard them), and the XLA
    compilation seconds in all. More compilations than signatures: the same shapes compiled
    again (for another device, or another sharding of an unsharded axis)."""
    shapes: dict[str, set[str]] = collections.defaultdict(set)
    for name, signature in _COMPILING.findall(log):
        shapes[name].add(signature)
    counts: collections.Counter[str] = collections.Counter()
    seconds: collections.Counter[str] = collections.Counter()
    for name, s in _COMPILED.findall(log):
        counts[name] += 1
        seconds[name] += float(s)
    return {
        name: {"count": counts[name], "signatures": len(shapes[name]), "seconds": seconds[name]}
        for name in sorted(counts)
    }


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

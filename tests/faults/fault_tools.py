"""Tools of the fault-injection suite: real CLI runs in subprocesses, killed, starved of disk or
of write permission, their files hashed before and after."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
from helpers import ROOT

# A small mlp with Dropout (its RNG stream is part of the state): a save takes tens of
# milliseconds, a run a few seconds, and every step depends on the data position and the RNG.
MLP = (
    "model=mlp",
    "data=digits",
    "model.hidden_sizes=[64,64]",
    "trainer.batch_size=64",
    "trainer.log_every=4",
    "logging.norms_every=0",
    "optimizer.warmup_steps=0",
)

# Run with no capabilities, so that mode bits apply even to root (the suite may run as root,
# which would otherwise write anywhere). util-linux's setpriv drops them before Python starts.
WITHOUT_CAPABILITIES = ("setpriv", "--bounding-set=-all", "--")


def start(*args: str, env: Mapping[str, str] | None = None, unprivileged: bool = False):
    """`python -m zoo.train ARGS` as a user runs it, one CPU device, not waited for."""
    return subprocess.Popen(
        [
            *(WITHOUT_CAPABILITIES if unprivileged and os.geteuid() == 0 else ()),
            sys.executable,
            "-m",
            "zoo.train",
            *args,
        ],
        cwd=ROOT,
        env={**os.environ, "JAX_NUM_CPU_DEVICES": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run(*args: str, timeout: float = 300, **options) -> tuple[int, str, float]:
    """(exit status, stderr, seconds) of a CLI run to its end."""
    started = time.monotonic()
    process = start(*args, **options)
    _, stderr = process.communicate(timeout=timeout)
    return process.returncode, stderr, time.monotonic() - started


def wait_for(condition: Callable[[], bool], process: subprocess.Popen, limit: float = 120) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def logged_step(workdir: Path, step: int, total: int) -> Callable[[], bool]:
    """True once train.log shows the log window that ends at `step`."""
    log = workdir / "train.log"
    return lambda: log.exists() and f"] step {step}/{total} " in log.read_text()


def snapshot(*directories: Path) -> dict[str, str]:
    """SHA-256 of every file under the directories: checkpoints and event files."""
    return {
        str(path): hashlib.sha256(path.read_bytes()).hexdigest()
        for directory in directories
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def kept(workdir: Path) -> dict[str, str]:
    """What a failed command must leave as it was: every checkpoint, event file, train.log and
    the recorded config of the workdir."""
    files = snapshot(workdir / "checkpoints", workdir / ".hydra")
    for path in [*workdir.glob("events.out.tfevents.*"), workdir / "train.log"]:
        if path.exists():
            files[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return files


def final_arrays(workdir: Path, step: int) -> dict[str, np.ndarray]:
    """Every array of the checkpoint at `step` (state and window), read on the host as numpy
    arrays (whatever devices wrote it)."""
    import jax
    import orbax.checkpoint as ocp
    from etils import epath
    from zoo.engine.checkpoints.checksums import flat

    arrays = {}
    for item in ("state", "window"):
        path = epath.Path(workdir) / "checkpoints" / str(step) / item
        handler = ocp.PyTreeCheckpointHandler()
        try:
            tree = handler.metadata(path).tree
            as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
            tree = handler.restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
        finally:
            handler.close()
        arrays.update(flat(tree, item))
    return arrays


def assert_same_arrays(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)

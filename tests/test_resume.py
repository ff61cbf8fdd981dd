"""Exact resume: runs killed with real signals in real subprocesses, resumed with the same
command, end with the bits of an uninterrupted run; plus the failure modes around checkpoints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import stateful_model
from flax import nnx
from helpers import ROOT, read_events, run_cli, scalar_steps

import zoo
from train.checkpoint import Checkpointer, abstract_like
from train.loop import Trainer

PLUGIN_ENV = {"ZOO_PLUGINS": "stateful_model", "PYTHONPATH": str(ROOT / "tests")}
STEPS, EVERY = 160, 20

XOR = ("model=xor", f"trainer.steps={STEPS}", "trainer.log_every=1")
STATEFUL = (f"model={stateful_model.NAME}", f"trainer.steps={STEPS}", "trainer.log_every=1")
FSDP8 = (*STATEFUL, "model.embed=16", "mesh.fsdp=8")
CASES = {"xor": XOR, "dropout_bn": STATEFUL, "dropout_bn_fsdp8": FSDP8}


def command(case: str, workdir) -> list[str]:
    return [*CASES[case], f"trainer.checkpoint_every={EVERY}", f"workdir={workdir}"]


def run_and_signal(args: list[str], workdir, kill_after: int, signum: int):
    """Start `python -m zoo.train ARGS`, wait until its train.log shows that step `kill_after`
    is done (each window's line is logged once the next window closes), then send `signum`."""
    process = subprocess.Popen(
        [sys.executable, "-m", "zoo.train", *args],
        cwd=ROOT,
        env={**os.environ, "JAX_NUM_CPU_DEVICES": "8", **PLUGIN_ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    log, marker = workdir / "train.log", f"] step {kill_after}/{STEPS} "
    while process.poll() is None:
        if log.exists() and marker in log.read_text():
            process.send_signal(signum)
            break
        time.sleep(0.002)
    _, stderr = process.communicate(timeout=300)
    return process.returncode, stderr


def restore_final(case: str, workdir, step: int = STEPS) -> nnx.State:
    """The state saved at `step`, restored onto the mesh that the case's config asks for."""
    trainer = Trainer(zoo.compose(command(case, workdir)))
    checkpointer = Checkpointer(workdir / "checkpoints")
    try:
        return checkpointer.restore_state(step, abstract_like(trainer.state))
    finally:
        checkpointer.close()


def assert_same_bits(a, b) -> None:
    def raw(x):
        return jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x

    paths_a, paths_b = jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)
    assert len(paths_a) == len(paths_b) > 0
    for (path, x), (_, y) in zip(paths_a, paths_b, strict=True):
        np.testing.assert_array_equal(np.asarray(raw(x)), np.asarray(raw(y)), err_msg=str(path))


def losses(workdir) -> dict[int, float]:
    events = read_events(workdir)
    scalars = events.Scalars("train/loss")
    steps = [event.step for event in scalars]
    assert len(steps) == len(set(steps)), "a step was logged twice"
    return scalar_steps(events, "train/loss")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One uninterrupted run per case, shared by the SIGKILL and SIGTERM tests."""
    done = {}

    def get(case: str):
        if case not in done:
            workdir = tmp_path_factory.mktemp(f"full-{case}")
            result = run_cli(*command(case, workdir), env=PLUGIN_ENV)
            assert result.returncode == 0, result.stderr
            done[case] = (restore_final(case, workdir), losses(workdir))
        return done[case]

    return get


@pytest.mark.parametrize(
    ("case", "signum", "seed"),
    [
        pytest.param("xor", signal.SIGKILL, 1, id="xor-SIGKILL"),
        pytest.param("xor", signal.SIGTERM, 2, id="xor-SIGTERM"),
        pytest.param("dropout_bn", signal.SIGKILL, 3, id="dropout_bn-SIGKILL"),
        pytest.param("dropout_bn", signal.SIGTERM, 4, id="dropout_bn-SIGTERM"),
        pytest.param("dropout_bn_fsdp8", signal.SIGKILL, 5, id="dropout_bn_fsdp8-SIGKILL"),
    ],
)
def test_killed_and_resumed_run_ends_with_the_same_bits(
    uninterrupted, tmp_path, case, signum, seed
):
    full_state, full_losses = uninterrupted(case)
    # A random step after the first checkpoint, far enough from the end to be reached first.
    kill_after = int(np.random.default_rng(seed).integers(EVERY + 1, STEPS // 2))
    args = command(case, tmp_path)

    code, stderr = run_and_signal(args, tmp_path, kill_after, signum)
    saved = Checkpointer(tmp_path / "checkpoints")
    steps = saved.all_steps()
    saved.close()
    if signum == signal.SIGKILL:
        assert code == -signal.SIGKILL, stderr
        restart = max(steps)
        assert EVERY <= restart < STEPS
    else:  # the step in flight finishes, a checkpoint is saved there, exit status 128 + 15
        assert code == 128 + signal.SIGTERM, stderr
        restart = max(steps)
        assert kill_after < restart < STEPS, steps
        assert f"Stopped by SIGTERM after step {restart}" in stderr
        assert "Traceback" not in stderr

    resumed = run_cli(*args, env=PLUGIN_ENV)
    assert resumed.returncode == 0, resumed.stderr
    assert f"Resuming at step {restart}" in resumed.stderr

    assert_same_bits(restore_final(case, tmp_path), full_state)
    resumed_losses = losses(tmp_path)
    assert set(range(restart + 1, STEPS + 1)) <= set(resumed_losses)
    assert set(resumed_losses) <= set(full_losses)
    for step, value in resumed_losses.items():
        assert value == full_losses[step], step  # the same float32 bits
    if signum == signal.SIGTERM:  # a clean stop flushed every window it had closed
        assert resumed_losses == full_losses

"""Two real processes on 127.0.0.1 with 4 CPU devices each, joined by `jax.distributed` and
gloo collectives, train exactly as one process with 8 devices does."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import deep_mlp
import pytest
from helpers import ROOT, read_events, scalar_steps

import zoo

PLUGIN_ENV = {"ZOO_PLUGINS": "deep_mlp", "PYTHONPATH": str(ROOT / "tests")}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_processes(workdir, *args: str, heartbeat: int = 100) -> list[subprocess.Popen]:
    port = free_port()
    env = {**os.environ, **PLUGIN_ENV}
    env.pop("JAX_NUM_CPU_DEVICES", None)
    common = [
        f"model={deep_mlp.MODEL}",
        f"workdir={workdir}",
        "mesh.cpu_devices=4",
        f"distributed.coordinator=127.0.0.1:{port}",
        "distributed.num_processes=2",
        f"distributed.heartbeat_timeout={heartbeat}",
        *args,
    ]
    return [
        subprocess.Popen(
            [sys.executable, "-m", "zoo.train", *common, f"distributed.process_id={i}"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]


@pytest.mark.parametrize("mesh", [["mesh.data=8"], ["mesh.data=1", "mesh.fsdp=8"]])
def test_two_processes_match_one_process_with_eight_devices(mesh, tmp_path):
    # The one process with 8 devices is this one (the plugin imported, as the CLI imports it).
    zoo.run(zoo.compose([f"model={deep_mlp.MODEL}", f"workdir={tmp_path / 'one'}", *mesh]))
    processes = start_processes(tmp_path / "two", *mesh)
    outputs = [p.communicate(timeout=300) for p in processes]
    for process, (_, stderr) in zip(processes, outputs, strict=True):
        assert process.returncode == 0, stderr
    assert "Process 0 of 2, 4 local devices of 8" in (tmp_path / "two" / "train.log").read_text()

    one, two = read_events(tmp_path / "one"), read_events(tmp_path / "two")
    losses_one, losses_two = scalar_steps(one, "train/loss"), scalar_steps(two, "train/loss")
    assert sorted(losses_one) == sorted(losses_two) == list(range(1, 21))
    for step, loss in losses_one.items():
        assert losses_two[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    assert scalar_steps(two, "val/loss")[20] == pytest.approx(
        scalar_steps(one, "val/loss")[20], rel=1e-5
    )
    assert (tmp_path / "two" / "checkpoints" / "20").is_dir()


def wait_for_step_20(workdir, processes):
    """Until both processes have logged step 20: training runs on every process."""
    log = workdir / "train.log"
    deadline = time.monotonic() + 120
    while "step 20/" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, "training did not start"
        assert all(p.poll() is None for p in processes)
        time.sleep(0.2)


def test_a_dead_process_stops_the_other_instead_of_hanging(tmp_path):
    processes = start_processes(
        tmp_path, "trainer.steps=1000000", "trainer.log_every=10", heartbeat=5
    )
    wait_for_step_20(tmp_path, processes)
    processes[1].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    try:
        processes[0].wait(timeout=120)
    finally:
        for p in processes:
            p.kill()
            p.communicate()
    assert processes[0].returncode != 0
    assert time.monotonic() - killed_at < 120


def test_a_sigterm_to_one_process_stops_every_process_at_the_same_step(tmp_path):
    processes = start_processes(tmp_path, "trainer.steps=1000000", "trainer.log_every=10")
    wait_for_step_20(tmp_path, processes)
    processes[1].send_signal(signal.SIGTERM)  # process 0 hears nothing from the scheduler
    stopped = time.monotonic()
    outputs = [p.communicate(timeout=120) for p in processes]
    assert time.monotonic() - stopped < 60
    assert [p.returncode for p in processes] == [128 + signal.SIGTERM] * 2, outputs
    saved = sorted(int(name) for name in os.listdir(tmp_path / "checkpoints") if name.isdigit())
    assert len(saved) == 1, saved  # one step, saved by both processes together
    for _, stderr in outputs:
        assert f"Stopped by SIGTERM after step {saved[0]}; saved" in stderr, stderr

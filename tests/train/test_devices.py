"""zoo.engine.report.devices: a run says which devices it computes on, and warns, naming the fix, when
a machine with an NVIDIA GPU (a driver file, or nvidia-smi on the PATH) trains on JAX's CPU
build; not on a GPU, not without a sign of one, not when JAX_PLATFORMS chose the platform."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import jax
import pytest
from zoo.engine.report import devices

import zoo

JAX = f"jax {jax.__version__}"


@contextmanager
def jax_platforms(value: str | None) -> Iterator[None]:
    """JAX_PLATFORMS as `value` (None: unset), whatever the suite was started with."""
    before = jax.config.jax_platforms
    jax.config.update("jax_platforms", value)
    try:
        yield
    finally:
        jax.config.update("jax_platforms", before)


def test_the_line_counts_the_devices_of_each_kind():
    assert devices.describe(jax.devices()) == f"devices: 8 x cpu ({JAX})"
    assert devices.describe(jax.devices()[:1]) == f"devices: 1 x cpu ({JAX})"
    # As a GPU run's devices describe themselves (device_kind, platform, process_index).
    h200 = [
        SimpleNamespace(device_kind="NVIDIA H200", platform="gpu", process_index=i // 8)
        for i in range(16)
    ]
    assert devices.describe(h200[:8]) == f"devices: 8 x NVIDIA H200 (gpu, {JAX})"
    assert devices.describe(h200) == f"devices: 16 x NVIDIA H200 (gpu, 2 processes, {JAX})"


@pytest.fixture
def no_gpu_signs(tmp_path, monkeypatch):
    """This machine as one without an NVIDIA GPU: no driver files, no nvidia-smi."""
    monkeypatch.setattr(devices, "NVIDIA_SIGNS", (str(tmp_path / "no-driver"),))
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    return tmp_path


def test_a_driver_file_or_nvidia_smi_is_a_sign_of_an_nvidia_gpu(no_gpu_signs, monkeypatch):
    assert devices.nvidia_gpu_sign() is None
    smi = no_gpu_signs / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\n")
    smi.chmod(0o755)
    assert devices.nvidia_gpu_sign() == str(smi)
    driver = no_gpu_signs / "version"
    driver.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module\n")
    monkeypatch.setattr(devices, "NVIDIA_SIGNS", (str(no_gpu_signs / "no-driver"), str(driver)))
    assert devices.nvidia_gpu_sign() == str(driver)


def test_the_warning_names_the_gpu_s_sign_and_the_fix():
    with jax_platforms(None):
        warning = devices.cpu_build_warning("cpu", "/dev/nvidia0")
        assert "NVIDIA GPU (/dev/nvidia0)" in warning and "CPU build" in warning
        assert 'pip install "zoo[cuda12]"' in warning and "uv sync --extra cuda12" in warning
        assert devices.cpu_build_warning("gpu", "/dev/nvidia0") is None
        assert devices.cpu_build_warning("cpu", None) is None
    with jax_platforms("cpu"):  # a choice, not a mistake
        assert devices.cpu_build_warning("cpu", "/dev/nvidia0") is None


def test_a_run_says_its_devices_and_warns_of_an_unused_gpu(tmp_path, monkeypatch):
    """A real run (8 CPU devices) on a machine made to show a driver file: both lines reach
    train.log (the console's lines, and more)."""
    driver = tmp_path / "version"
    driver.write_text("NVRM version\n")
    monkeypatch.setattr(devices, "NVIDIA_SIGNS", (str(driver),))
    workdir = tmp_path / "run"
    with jax_platforms(None):
        zoo.fit("xor", "trainer.steps=50", f"workdir={workdir}")
    log = (workdir / "train.log").read_text()
    assert f"[zoo][INFO] devices: 8 x cpu ({JAX})" in log
    assert f"[zoo][WARNING] This machine has an NVIDIA GPU ({driver})" in log

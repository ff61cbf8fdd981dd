"""Which devices a run computes on, said as it starts, and a warning when a machine with an
NVIDIA GPU trains on the CPU: JAX installs its CPU build by default, and a run on it works,
only many times slower, so nothing else would tell."""

from __future__ import annotations

import importlib.metadata
import shutil
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import jax

NVIDIA_SIGNS = ("/proc/driver/nvidia/version", "/dev/nvidia0")
"""Files an NVIDIA driver makes (besides `nvidia-smi` on the PATH): one of them is enough."""
CUDA_PLUGINS = ("jax-cuda12-plugin", "jax-cuda13-plugin")
"""JAX's CUDA backends, installed by the `cuda12` / `cuda13` extras."""


def describe(devices: Iterable[jax.Device]) -> str:
    """One line: how many devices of each kind, their platform, the processes that drive them
    (if several) and jax's version; e.g. `devices: 8 x NVIDIA H200 (gpu, jax 0.10.2)`."""
    devices = list(devices)
    kinds = Counter(d.device_kind for d in devices)
    platform = devices[0].platform
    about = [] if all(kind == platform for kind in kinds) else [platform]
    processes = len({d.process_index for d in devices})
    if processes > 1:
        about.append(f"{processes} processes")
    about.append(f"jax {jax.__version__}")
    counts = ", ".join(f"{n} x {kind}" for kind, n in kinds.items())
    return f"devices: {counts} ({', '.join(about)})"


def nvidia_gpu_sign() -> str | None:
    """The first sign of an NVIDIA GPU on this machine (one of `NVIDIA_SIGNS`, or `nvidia-smi`'s
    path), or None."""
    found = next((s for s in NVIDIA_SIGNS if Path(s).exists()), None)
    return found or shutil.which("nvidia-smi")


def cpu_build_warning(platform: str, sign: str | None) -> str | None:
    """What to tell a run on `platform` on a machine where `sign` shows an NVIDIA GPU (None:
    nothing). Not when JAX_PLATFORMS chose the platforms: that is a choice, not a mistake."""
    if platform != "cpu" or sign is None or jax.config.jax_platforms:
        return None
    plugin = _cuda_plugin()
    if plugin:
        return (
            f"This machine has an NVIDIA GPU ({sign}) and {plugin} is installed, but JAX runs on "
            "the CPU: its CUDA backend did not start (JAX logs why as it starts; a driver older "
            "than the plugin needs is a common cause). Check with "
            "python -c 'import jax; print(jax.devices())'."
        )
    return (
        f"This machine has an NVIDIA GPU ({sign}), but JAX runs on the CPU: the installed jaxlib "
        "is its CPU build. Install the CUDA build with zoo's extra: "
        'pip install "zoo[cuda12]" (or uv sync --extra cuda12; cuda13 for CUDA 13 drivers).'
    )


def _cuda_plugin() -> str | None:
    """The installed CUDA plugin and its version, or None."""
    for name in CUDA_PLUGINS:
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None

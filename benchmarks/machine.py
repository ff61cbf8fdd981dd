"""The CPU a benchmark ran on, printed beside its table: machines of one kind differ (the same
cloud machine type has come with CPUs whose float32 matmul peaks differ by 2.4x), and what
PyTorch gains over XLA:CPU in bfloat16 depends on the vector units (AVX-512 BF16, AMX).

    python -m benchmarks.machine
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

VECTOR_FEATURES = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "amx_fp16",
)
"""The flags (as /proc/cpuinfo names them) that decide which float32 and bfloat16 kernels run."""


def cpu() -> dict[str, Any]:
    """The CPU's model name, logical cores and which of `VECTOR_FEATURES` it has (from
    /proc/cpuinfo; on a machine without it, the model as `platform` reports it and no
    features)."""
    model, flags = platform.processor() or platform.machine(), set()
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    return {
        "model": model,
        "cores": os.cpu_count(),
        "features": [f for f in VECTOR_FEATURES if f in flags],
        "missing": [f for f in VECTOR_FEATURES if f not in flags],
    }


def describe(info: dict[str, Any] | None = None) -> str:
    """One line: the model, cores, the vector features it has and those it lacks."""
    info = info or cpu()
    missing = f"; without {' '.join(info['missing'])}" if info["missing"] else ""
    return f"CPU: {info['model']}, {info['cores']} cores; {' '.join(info['features'])}{missing}"


if __name__ == "__main__":
    print(describe())

"""Checks of bits that hold only as users' XLA:CPU compiles, run in a process that compiles so.

The suite turns XLA:CPU's MLIR fusion emitters off where its XLA can (`tests/conftest.py`):
that takes a third off its compilations, and every comparison in it holds either way but one.
The older emitters it falls back to vectorise some elementwise work (an initialiser's normal
draws) by shape, so a layer initialised under `vmap` (`scan_layers`) rounds 1 ulp away from the
same layer initialised alone, where the emitters users run with give the same bits, as zoo
promises. Those checks run here, in a fresh process with the emitters on.
"""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import ROOT

EMITTERS_OFF = "--xla_cpu_use_fusion_emitters=false"


def run(module: str, function: str, *args) -> None:
    """`module.function(*args)` (a module of the tests' folders) in a fresh process on 8
    simulated devices, with XLA:CPU's fusion emitters on; fails with that process's error."""
    folders = [ROOT / "tests", ROOT / "tests" / "models", ROOT]
    flags = os.environ.get("XLA_FLAGS", "")
    if EMITTERS_OFF in flags:  # an XLA that has the older emitters; the last flag wins
        flags += " --xla_cpu_use_fusion_emitters=true"
    env = {
        **os.environ,
        "JAX_NUM_CPU_DEVICES": "8",
        "XLA_FLAGS": flags,
        "PYTHONPATH": os.pathsep.join(map(str, folders)),
    }
    code = f"import {module}; {module}.{function}(*{args!r})"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]

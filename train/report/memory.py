"""What a compiled train step needs on each device: XLA's own accounting of its arguments
(state, batch), outputs and temporaries (activations kept for the backward pass, gradients),
read from `compiled.memory_analysis()` without running the step.

A run reports it before its first dispatch (`announce`), from the compilation that dispatch
then uses: jax keeps the executable that `jitted.lower(args).compile()` built, and calling
`jitted(args)` with arguments of the same shapes and shardings reuses it, so reporting costs
no second compilation.

On devices whose allocator keeps statistics (GPUs, TPUs; not XLA:CPU), each log window also
reports the device memory the run holds and its high-water mark (`device_memory`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from zoo.engine.report.reporter import Reporter
from zoo.engine.sharding import mesh as sharding
from zoo.engine.sharding.plan import readable_size
from zoo.engine.steps.functions import zero_metrics

log = logging.getLogger("zoo")

FIELDS = {
    "arguments": "argument_size_in_bytes",
    "outputs": "output_size_in_bytes",
    "temporaries": "temp_size_in_bytes",
    "aliased": "alias_size_in_bytes",
}


def compiled_memory(jitted: Any, *args: Any) -> dict[str, int] | None:
    """Bytes per device of `jitted` compiled for `args` (None where the backend does not say);
    see `memory_of`."""
    return memory_of(jitted.lower(*args).compile())


def memory_of(compiled: Any) -> dict[str, int] | None:
    """Bytes per device of a compiled program (`jax.stages.Compiled`; None where the backend
    does not say). `peak` counts arguments, outputs and temporaries, less the outputs written
    in place of donated arguments."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return None
    sizes = {name: int(getattr(analysis, field, 0) or 0) for name, field in FIELDS.items()}
    sizes["peak"] = sizes["arguments"] + sizes["outputs"] + sizes["temporaries"] - sizes["aliased"]
    return sizes


def step_memory(trainer: Any) -> dict[str, int]:
    """Bytes per device of `trainer`'s train step on its first batch (a compilation of its
    own: call it where that time is affordable, e.g. a benchmark)."""
    return memory_of(compiled_train_step(trainer)[0])


def compiled_train_step(trainer: Any) -> tuple[Any, tuple]:
    """`trainer`'s train step compiled for its first batch, and the arguments it takes
    (state, zero metric sums, the batch on the devices, the step key): a benchmark can run the
    step, read its memory and its program from this one compilation."""
    with sharding.activate(trainer.mesh, trainer.rules):
        batch = trainer.shard(next(iter(trainer.train_data)))
        sums = zero_metrics(trainer.train_step, trainer.state, {}, batch, trainer.step_key)
        args = (trainer.state, sums, batch, trainer.step_key)
        return trainer.train_step.lower(*args).compile(), args


def announce(jitted: Any, args: tuple, steps: int, reporter: Reporter, step: int) -> None:
    """Compile `jitted` (the dispatch of `steps` train steps) for `args`, the first dispatch's
    own arguments; log its bytes per device and write them to TensorBoard at `step` (scalars
    `xla/memory_*_bytes` and a `memory` text table)."""
    sizes = compiled_memory(jitted, *args)
    if sizes is None:
        return
    what = "train step" if steps == 1 else f"dispatch of {steps} train steps"
    parts = ", ".join(f"{name} {readable_size(size)}" for name, size in sizes.items())
    log.info("Memory per device of the compiled %s: %s", what, parts)
    reporter.scalars("xla", step, {f"memory_{name}_bytes": size for name, size in sizes.items()})
    rows = [
        f"    {name:<12} {size:>14,} bytes  {readable_size(size):>12}"
        for name, size in sizes.items()
    ]
    reporter.text("memory", "\n".join([f"    per device, compiled {what}", *rows]), step)


def device_memory(devices: Iterable[Any]) -> dict[str, int]:
    """Bytes in use now and the most ever in use (since the process started: XLA's allocator
    keeps no resettable peak), the largest over `devices`; empty where a backend keeps no
    statistics (XLA:CPU returns none)."""
    stats = [device.memory_stats() for device in devices]
    if not stats or any(not s or "peak_bytes_in_use" not in s for s in stats):
        return {}
    return {
        "device_in_use_bytes": max(int(s.get("bytes_in_use", 0)) for s in stats),
        "device_peak_bytes": max(int(s["peak_bytes_in_use"]) for s in stats),
    }

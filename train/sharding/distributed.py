"""Start-up of the JAX runtime: simulated CPU devices and multi-process (`jax.distributed`).

Both must happen before JAX picks its devices, so the trainer calls `initialize` first.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import jax
from zoo.engine.errors import ZooError

log = logging.getLogger("zoo")

# Environment variables by which JAX itself finds a multi-process job.
_CLUSTER_ENV = ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE")


def initialize(cfg: Any) -> None:
    """Apply `mesh.cpu_devices` and, when configured or found in the environment, join the
    multi-process job. Safe to call more than once."""
    if cfg.mesh.cpu_devices:
        _set_before_start("jax_num_cpu_devices", int(cfg.mesh.cpu_devices), "mesh.cpu_devices")
    dist = cfg.distributed
    wanted = dist.coordinator is not None or any(var in os.environ for var in _CLUSTER_ENV)
    if not wanted or jax.distributed.is_initialized():
        return
    # CPU devices of different processes talk through gloo; other platforms ignore this.
    _set_before_start("jax_cpu_collectives_implementation", "gloo", "distributed")
    try:
        jax.distributed.initialize(
            coordinator_address=dist.coordinator,
            num_processes=dist.num_processes,
            process_id=dist.process_id,
            heartbeat_timeout_seconds=int(dist.heartbeat_timeout),
        )
    except (ValueError, TypeError, RuntimeError) as e:
        raise ZooError(
            f"Cannot join the multi-process job (distributed.coordinator={dist.coordinator}, "
            f"num_processes={dist.num_processes}, process_id={dist.process_id}): "
            f"{' '.join(str(e).split())}"
        ) from None
    log.info(
        "Process %d of %d, %d local devices of %d",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def _set_before_start(option: str, value: Any, key: str) -> None:
    if getattr(jax.config, option) == value:
        return
    try:
        jax.config.update(option, value)
    except RuntimeError as e:
        raise ZooError(
            f"Cannot apply {key}: JAX has already started its devices ({e}). Set it before "
            "anything uses JAX, e.g. on the command line."
        ) from None

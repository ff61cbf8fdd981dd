"""The Orbax handler of a checkpoint's `state` and `window` items: Orbax's own
(`StandardSave`, `StandardRestore`), with each replicated array copied to the host whole on CPU
devices."""

from __future__ import annotations

import jax
import numpy as np
import orbax.checkpoint as ocp


def _copies_whole_shards() -> ocp.type_handlers.TypeHandlerRegistry:
    """Orbax's default type handlers, but for jax.Array one that copies each replicated array to
    the host whole, from one device, instead of a slice from each (`use_replica_parallel`).

    The slices spread a save's writing over the hosts of a multi-host run; on a CPU every device
    is the host's own memory, so they cost a sliced copy per device and array (672 eager slices,
    of 64 shapes each compiled once, for a tiny gpt replicated on 8 CPU devices) and gain nothing.
    The saved arrays are the same; their chunks on disk are whole shards."""
    kept = [int, float, bytes, np.number, np.ndarray, str, type(...)]
    arrays = ocp.type_handlers.get_type_handler(jax.Array)
    whole = ocp.type_handlers.ArrayHandler(
        use_replica_parallel=False,
        array_metadata_store=arrays._array_metadata_store,  # the default handler's
    )
    handlers = [(t, ocp.type_handlers.get_type_handler(t)) for t in kept]
    return ocp.type_handlers.create_type_handler_registry((jax.Array, whole), *handlers)


class StateHandler(ocp.StandardCheckpointHandler):
    """Orbax's handler of `StandardSave` and `StandardRestore`, on CPU devices with the type
    handlers of `_copies_whole_shards`. It has no option for them, so the PyTree handler it
    delegates to (`_impl`) is replaced by one built with them, whose array handler shares the
    default's metadata store (`_array_metadata_store`): an Orbax that renames either fails
    tests/train/test_checkpoint_layout.py."""

    def __init__(self):
        super().__init__()
        if jax.devices()[0].platform == "cpu":
            self._impl = ocp.PyTreeCheckpointHandler(type_handler_registry=_copies_whole_shards())

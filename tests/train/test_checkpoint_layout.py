"""What a checkpoint of arrays sharded and replicated over 8 CPU devices holds on disk: each array
written as whole shards, one device's copy of each (not a slice from every replica, Orbax's
default), and read back to the same bits."""

import json

import grain
import jax
import numpy as np
from helpers import assert_same_bits
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from zoo.engine.checkpoints.manager import Checkpointer
from zoo.engine.checkpoints.reader import abstract_like

SPECS = {"replicated": P(), "fsdp": P("fsdp"), "fsdp_tensor": P("fsdp", "tensor")}


def test_each_array_is_written_as_whole_shards_and_read_back(tmp_path):
    mesh = jax.make_mesh((2, 2, 2), ("data", "fsdp", "tensor"))
    values = np.arange(16 * 24, dtype=np.float32).reshape(16, 24) * 0.37
    state = {
        name: jax.device_put(values, NamedSharding(mesh, spec)) for name, spec in SPECS.items()
    }
    data = iter(grain.MapDataset.range(4).to_iter_dataset())
    checkpointer = Checkpointer(tmp_path)
    try:
        checkpointer.save(1, state, data, {})
        checkpointer.wait()
        restored = checkpointer.restore_state(1, abstract_like(state))
    finally:
        checkpointer.close()
    assert_same_bits(restored, state)
    written = json.loads((tmp_path / "1" / "state" / "array_metadatas" / "process_0").read_text())
    shapes = {
        entry["array_metadata"]["param_name"]: entry["array_metadata"]["write_shape"]
        for entry in written["array_metadatas"]
    }
    assert shapes == {"replicated": [16, 24], "fsdp": [8, 24], "fsdp_tensor": [8, 12]}

"""A run reports what its compiled train step needs on each device (XLA's memory analysis)
before the first step: one console and train.log line, TensorBoard scalars and a text table,
all from the one compilation the step runs with."""

from __future__ import annotations

import logging
import re

import jax
from flax import nnx
from helpers import read_events, scalar_steps
from zoo.engine.report.memory import device_memory

import zoo

ARGS = (
    "data=digits",
    "model.hidden_sizes=[16]",
    "trainer.batch_size=16",
    "trainer.steps=4",
    "trainer.log_every=2",
    "optimizer.warmup_steps=0",
    "logging.norms_every=0",
)
NAMES = ("arguments", "outputs", "temporaries", "aliased", "peak")


def test_the_step_memory_is_reported_from_the_one_compilation(tmp_path, caplog, fresh_compiles):
    with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
        result = zoo.fit("mlp", *ARGS, f"workdir={tmp_path}")
    finished = [
        r.getMessage() for r in caplog.records if "Finished XLA compilation" in r.getMessage()
    ]
    assert sum("jit(train_step)" in line for line in finished) == 1, finished

    events = read_events(tmp_path)
    sizes = {name: scalar_steps(events, f"xla/memory_{name}_bytes") for name in NAMES}
    assert all(list(by_step) == [0] for by_step in sizes.values())  # at the run's start
    size = {name: by_step[0] for name, by_step in sizes.items()}
    assert (
        size["peak"] == size["arguments"] + size["outputs"] + size["temporaries"] - size["aliased"]
    )
    # the arguments hold the train state: float32 params and Adam's two moments
    state_bytes = 3 * 4 * sum(x.size for x in jax.tree.leaves(nnx.state(result.model, nnx.Param)))
    assert size["arguments"] >= state_bytes and size["temporaries"] > 0

    (table,) = events.Tensors("memory/text_summary")
    assert f"{int(size['peak']):,} bytes" in table.tensor_proto.string_val[0].decode()
    log_text = (tmp_path / "train.log").read_text()
    line = re.search(r"Memory per device of the compiled train step: (.*)", log_text).group(1)
    assert line.startswith("arguments ") and " peak " in line
    # XLA:CPU keeps no allocator statistics: no device-memory scalars rather than zeros
    assert not [tag for tag in events.Tags()["scalars"] if tag.startswith("xla/device_")]


class _Device:
    """A device as `jax.Device.memory_stats()` describes it on a GPU."""

    def __init__(self, stats):
        self._stats = stats

    def memory_stats(self):
        return self._stats


def test_device_memory_is_the_largest_in_use_and_peak_over_the_devices():
    gpus = [
        _Device({"bytes_in_use": 5, "peak_bytes_in_use": 90, "bytes_limit": 100}),
        _Device({"bytes_in_use": 7, "peak_bytes_in_use": 60, "bytes_limit": 100}),
    ]
    assert device_memory(gpus) == {"device_in_use_bytes": 7, "device_peak_bytes": 90}
    assert device_memory(jax.local_devices()) == {}  # XLA:CPU: None
    assert device_memory([]) == {}

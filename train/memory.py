"""What a compiled train step needs on each device: XLA's own accounting of its arguments
(state, batch), outputs and temporaries (activations kept for the backward pass, gradients),
read from `compiled.memory_analysis()` without running the step."""

from __future__ import annotations

from typing import Any

import jax

from train import sharding

FIELDS = {
    "arguments": "argument_size_in_bytes",
    "outputs": "output_size_in_bytes",
    "temporaries": "temp_size_in_bytes",
    "aliased": "alias_size_in_bytes",
}


def step_memory(trainer: Any) -> dict[str, int]:
    """Bytes per device of `trainer`'s train step on its first batch (a compilation of its
    own: call it where that time is affordable, e.g. a benchmark). `peak` counts arguments,
    outputs and temporaries, less the outputs written in place of donated arguments."""
    with sharding.activate(trainer.mesh, trainer.rules):
        batch = trainer.shard(next(iter(trainer.train_data)))
        zeros = jax.eval_shape(trainer.train_step, trainer.state, {}, batch, trainer.step_key)[1]
        compiled = trainer.train_step.lower(trainer.state, zeros, batch, trainer.step_key).compile()
    analysis = compiled.memory_analysis()
    sizes = {name: int(getattr(analysis, field, 0) or 0) for name, field in FIELDS.items()}
    sizes["peak"] = sizes["arguments"] + sizes["outputs"] + sizes["temporaries"] - sizes["aliased"]
    return sizes

"""FSDP shards every param it can: under `mesh.fsdp=8` each device holds 1/8 of every zoo
model's kernels and embeddings, and the plan names the params it leaves whole."""

from __future__ import annotations

import pytest
from conformance.checks import RULES, make_mesh, tiny_hparams, zoo_models
from flax import nnx
from jax.sharding import PartitionSpec as P
from zoo.engine import registry
from zoo.engine.loop.build import abstract_model
from zoo.engine.sharding import mesh as sharding
from zoo.engine.sharding.plan import plan_state

FSDP8 = {"data": 1, "fsdp": 8, "tensor": 1}


def fsdp8_plan(name: str, *overrides: str):
    """The plan of the tiny `name` (`overrides` on top) on `mesh.fsdp=8`, from an abstract
    build: no array is made."""
    mesh = make_mesh(FSDP8)
    with sharding.activate(mesh, RULES):
        model = abstract_model(registry.get_model(name), tiny_hparams(name, *overrides), 0)
        return plan_state(nnx.state((model,)), mesh, RULES)


SMALL = 1024
"""Params below this many bytes are too small to matter (xor's are 64 and 32): a model need not
name a dimension of theirs for FSDP."""


def splittable(row) -> bool:
    """A param that FSDP can split: 1 KiB or more, with a dimension that 8 divides other than its
    last (a layer's output features, which meet the batch's use of `fsdp`)."""
    return row.bytes_total >= SMALL and any(size % 8 == 0 for size in row.shape[:-1])


@pytest.mark.parametrize("name", zoo_models())
def test_each_device_holds_an_eighth_of_the_params(name):
    plan = fsdp8_plan(name)
    kernels = [row for row in plan.rows if row.group == "params" and len(row.shape) >= 2]
    measured = [row for row in kernels if splittable(row)]
    assert measured or name == "xor", "the model has no param that fsdp=8 could split"
    per_device = sum(row.bytes_per_device for row in measured)
    total = sum(row.bytes_total for row in measured)
    assert per_device <= 1.05 * total / 8, [
        (row.path, row.shape, str(row.spec))
        for row in measured
        if row.bytes_per_device * 8 > row.bytes_total
    ]
    notes = "\n".join(plan.notes())
    for row in kernels:
        if row.bytes_per_device == row.bytes_total:
            # the plan names three paths per reason and counts the rest ("and 6 more"): a small
            # one (siglip's attention biases) may be among those counted
            counted = row.bytes_total < SMALL and any(note in notes for note in row.notes)
            assert row.path in notes or counted, (
                f"{row.path} is whole on every device, and the plan is silent"
            )


def test_the_plan_names_the_params_fsdp_keeps_whole():
    plan = fsdp8_plan("cnn")  # its first convolution reads one input channel (digits)
    stem = plan.row("blocks.0.conv.kernel")
    assert stem.bytes_per_device == stem.bytes_total
    line = "whole on every device: fsdp=8 cannot divide the dimension named for it"
    assert f"{line}: blocks.0.conv.kernel" in plan.table()
    assert "blocks.1.conv.kernel" not in plan.table().split(line)[1]


def test_a_dimension_named_for_two_axes_is_split_on_both():
    # Three hidden layers: the head's input features are on `tensor`.
    plan = fsdp8_plan("mlp", "model.hidden_sizes=[32,32,32]")
    head = plan.row("head.kernel")
    assert head.logical == (("mlp", "embed"), None)
    assert head.spec == P(("tensor", "fsdp"), None)
    assert head.bytes_per_device * 8 == head.bytes_total
    assert "whole on every device: no dimension named for fsdp: hidden.kernel, output.kernel" in (
        fsdp8_plan("xor").notes()
    )

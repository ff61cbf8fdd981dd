"""The `kv_heads` logical axis (grouped-query attention's key/value heads): on `tensor` where the
tensor size divides them; whole on it where it does not (two KV heads on four tensor devices),
said in one line of the plan, while every other axis a mesh cannot divide stays an error."""

from __future__ import annotations

import jax
import pytest
from conformance.checks import make_mesh
from flax import nnx
from jax.sharding import PartitionSpec as P
from zoo.engine.sharding import mesh as sharding
from zoo.engine.sharding.plan import create_sharded

from zoo.plugin import ZooError, partitioned

RULES = sharding.AxisRules.from_mapping(sharding.DEFAULT_RULES)


class KeyValue(nnx.Module):
    """Key and value projections: `dim` features -> (`kv_heads`, head size)."""

    def __init__(self, kv_heads: int, head_axis: str = "kv_heads", *, rngs: nnx.Rngs):
        init = partitioned(nnx.initializers.lecun_normal(), ("embed", head_axis, None))
        self.key = nnx.Param(init(rngs.params(), (16, kv_heads, 8)))
        self.value = nnx.Param(init(rngs.params(), (16, kv_heads, 8)))


def built(mesh: dict[str, int], kv_heads: int, head_axis: str = "kv_heads"):
    on = make_mesh(mesh)
    with sharding.activate(on, RULES):
        (model,), plan = create_sharded(
            lambda: (KeyValue(kv_heads, head_axis, rngs=nnx.Rngs(0)),), on, RULES
        )
    return model, plan


def test_kv_heads_shard_on_tensor_where_it_divides_them():
    model, plan = built({"data": 4, "fsdp": 1, "tensor": 2}, kv_heads=2)
    assert plan.row("key").spec == P("fsdp", "tensor", None)
    assert jax.typeof(model.key[...]).sharding.spec == P("fsdp", "tensor", None)
    assert plan.notes() == []


def test_kv_heads_stay_whole_on_a_tensor_axis_that_cannot_divide_them():
    model, plan = built({"data": 2, "fsdp": 1, "tensor": 4}, kv_heads=2)
    for name in ("key", "value"):
        assert plan.row(name).spec == P("fsdp", None, None)
        assert jax.typeof(getattr(model, name)[...]).sharding.spec == P("fsdp", None, None)
    assert plan.notes() == ["kv_heads of size 2 replicated on tensor=4 (4 ways): key, value"]
    assert "  kv_heads of size 2 replicated on tensor=4 (4 ways): key, value" in plan.table()


def test_query_heads_that_the_tensor_axis_cannot_divide_are_still_refused():
    with pytest.raises(ZooError, match=r"'key' \(shape \(16, 2, 8\)\) has dimension 1 of size 2"):
        built({"data": 2, "fsdp": 1, "tensor": 4}, kv_heads=2, head_axis="heads")


def test_an_unknown_logical_axis_is_named():
    with pytest.raises(ZooError, match=r"uses the logical axis 'kv_head', which no sharding rule"):
        built({"data": 4, "fsdp": 1, "tensor": 2}, kv_heads=2, head_axis="kv_head")

"""Meshes and sharding: the device mesh and the logical-axis rules (`mesh`), the plan they give
every param (`plan`), abstract arrays that carry their sharding (`abstract`), and several
processes as one (`distributed`)."""

from zoo.engine.sharding.abstract import partitioned, repeated
from zoo.engine.sharding.mesh import (
    DEFAULT_RULES,
    AxisRules,
    activate,
    batch_divisor,
    deactivated,
    logical_spec,
    make_mesh,
    mesh_and_rules,
    shard_batch,
    unsplit_batch,
)
from zoo.engine.sharding.plan import check_experts_split

__all__ = [
    "DEFAULT_RULES",
    "AxisRules",
    "activate",
    "batch_divisor",
    "check_experts_split",
    "deactivated",
    "logical_spec",
    "make_mesh",
    "mesh_and_rules",
    "partitioned",
    "repeated",
    "shard_batch",
    "unsplit_batch",
]

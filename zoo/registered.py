"""Models and data sets by their registered names: a model built with fresh parameters
(`zoo.create_model`) and a data set's splits (`zoo.load_data`), their keys type-checked as a
run's config checks them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax import nnx

from zoo.engine import registry, sharding
from zoo.engine.config import MeshConfig, checked_dict, checked_params
from zoo.engine.loop import build_on_mesh


def load_data(name: str, **params: Any) -> registry.Splits:
    """A registered data set's splits, e.g. `load_data("digits")`; `params` are its `data.*`
    keys (`load_data("fashion_mnist", download=False)`), type-checked."""
    entry = registry.get_data(name)
    return entry.splits(checked_params(f"data set '{name}'", entry.config, params))


def create_model(
    name: str,
    *,
    data: str | None = None,
    seed: int = 0,
    mesh: Mapping[str, Any] | None = None,
    devices: Any = None,
    **overrides: Any,
) -> nnx.Module:
    """Build a registered model with fresh parameters, e.g. `create_model("xor", num_hidden=16)`.

    Parameters the data set decides (`input_shape`, `num_classes`) come from `data` (default: the
    model's own default data set) unless given.

    The params are born sharded on a device mesh, as their logical annotations and the rules
    ask; `mesh` takes the keys of the `mesh` config section (default: data parallel over every
    device), `devices` restricts it to some devices. Call the model under
    `zoo.engine.sharding.mesh.activate(...)` (or use the trainer), since explicit sharding needs a mesh.
    """
    entry = registry.get_model(name)
    hparams = checked_params(f"model '{name}'", entry.config, overrides)
    hparams = entry.resolve(hparams, registry.get_data(data or entry.default_data))
    device_mesh, rules = sharding.mesh_and_rules(
        checked_dict(MeshConfig, dict(mesh or {}), "mesh"), devices
    )
    return build_on_mesh(entry, hparams, seed, device_mesh, rules).model

"""What the conformance suite and the models' own tests share: the models it runs (every
registered model that declares a `tiny` configuration), their tiny configs, the meshes (one
device, and 2x2x2 over the 8 simulated devices) and the checks of a model's sharding."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from helpers import overriding
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from omegaconf import DictConfig, OmegaConf
from zoo.engine import registry
from zoo.engine.loop.build import abstract_model, build_model
from zoo.engine.sharding import abstract
from zoo.engine.sharding import mesh as sharding
from zoo.engine.sharding.mesh import DEFAULT_RULES

import zoo
from zoo.cli import plugin_modules
from zoo.trained import resolved_hparams

MESH = {"data": 2, "fsdp": 2, "tensor": 2}
ONE_DEVICE = {"data": 1, "fsdp": 1, "tensor": 1}
RULES = sharding.AxisRules.from_mapping(DEFAULT_RULES)
PLUGINS = ["conformance.plugin_model", *plugin_modules()]
"""The modules whose models the suite runs besides zoo's own: the test plugin, and those
`$ZOO_PLUGINS` names (comma-separated, as the command lines read it)."""


def load_plugins() -> None:
    for plugin in PLUGINS:
        importlib.import_module(plugin)


def tiny_models() -> list[str]:
    """The registered models that declare a tiny configuration, zoo's own and a plugin's."""
    return [name for name in zoo.list_models() if registry.get_model(name).tiny]


def zoo_models(*plugins: str) -> list[str]:
    """The models that zoo registers (and those the modules `plugins` register)."""
    packages = ("zoo.", *plugins)
    return [
        name
        for name in zoo.list_models()
        if registry.get_model(name).constructor.__module__.startswith(packages)
    ]


def tiny_config(name: str, *overrides: str) -> DictConfig:
    """Model `name` and its data as its `tiny` overrides make them, `overrides` on top."""
    return zoo.compose(overriding(f"model={name}", *registry.get_model(name).tiny, *overrides))


def tiny_hparams(name: str, *overrides: str) -> dict[str, Any]:
    """The constructor arguments of the tiny `name` (its data set's facts filled in)."""
    return resolved_hparams(tiny_config(name, *overrides))


def data_params(config: DictConfig) -> dict[str, Any]:
    """The `data.*` keys of `config`, as the data set's loader takes them."""
    params = OmegaConf.to_container(config.data, enum_to_str=True)
    return {key: value for key, value in params.items() if key != "name"}


def make_mesh(sizes: Mapping[str, int]) -> jax.sharding.Mesh:
    devices = jax.devices()[: int(np.prod(list(sizes.values())))]
    return sharding.make_mesh(dict(sizes), devices)


@contextlib.contextmanager
def on_mesh(sizes: Mapping[str, int] = MESH) -> Iterator[None]:
    with sharding.activate(make_mesh(sizes), RULES):
        yield


def on_one_device(model: nnx.Module) -> nnx.Module:
    """A copy of `model` whose every array lives whole on the first device."""
    graphdef, state = nnx.split(model)
    one = NamedSharding(make_mesh(ONE_DEVICE), P())
    return nnx.merge(graphdef, jax.tree.map(lambda x: jax.device_put(x, one).copy(), state))


def described(model: nnx.Module) -> tuple:
    """A model's structure and every variable's path, type, shape, dtype and metadata."""
    graphdef, state = nnx.split(model)
    return graphdef, [
        (path, type(v).__name__, v.shape, v.dtype, v.get_metadata())
        for path, v in nnx.to_flat_state(state)
    ]


def param_key(path: tuple) -> str:
    return ".".join(str(part) for part in path)


def born_sharding(model: nnx.Module, mesh: jax.sharding.Mesh) -> list[tuple[str, Any, P, P]]:
    """Each param of a model built on `mesh`: (path, logical axes, the spec it lives with, the
    spec its axes give under the default rules)."""
    rows = []
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        key, value = param_key(path), variable[...]
        axes = variable.get_metadata().get("out_sharding")
        planned = (
            RULES.spec(axes, value.shape, mesh, key) if axes and len(axes) == value.ndim else None
        )
        rows.append((key, axes, jax.typeof(value).sharding.spec, planned))
    return rows


def assert_born_sharded_as_planned(rows: list[tuple[str, Any, P, P]]) -> list[str]:
    """Every param (rows of `born_sharding`) is annotated on each of its dimensions and lives
    where the rules put it; returns the paths of those split over the mesh (at least one)."""
    assert rows, "the model has no params"
    for key, axes, spec, planned in rows:
        assert planned is not None, f"{key}: logical axes {axes} do not name each dimension"
        assert spec == planned, f"{key}: born as {spec}, its axes {axes} say {planned}"
    split = [key for key, _, spec, _ in rows if any(entry is not None for entry in spec)]
    assert split, "no param is split over the mesh"
    return split


def planned_split(name: str, *overrides: str) -> set[str]:
    """The params of the tiny `name` (`overrides` on top) that the default rules split over
    the 2x2x2 mesh, from an abstract build: no array is made."""
    entry, hparams = registry.get_model(name), tiny_hparams(name, *overrides)
    mesh = make_mesh(MESH)
    with sharding.activate(mesh, RULES):
        model = abstract_model(entry, hparams, 0)
    return {
        param_key(path)
        for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param))
        if any(RULES.spec(variable.get_metadata()["out_sharding"], variable.shape, mesh, "p"))
    }


def assert_abstract_build_equals_the_full_trace(name: str, *overrides: str) -> None:
    """The tiny `name` (`overrides` on top), built abstractly, is exactly what tracing its
    constructor in full gives, each variable its own."""
    entry, hparams = registry.get_model(name), tiny_hparams(name, *overrides)
    with nnx.use_eager_sharding(False):
        full = nnx.eval_shape(lambda: build_model(entry, hparams, 0))
        fast = abstract.eval_shape(lambda: build_model(entry, hparams, 0))
    assert described(fast) == described(full)
    variables = [v for _, v in nnx.to_flat_state(nnx.state(fast))]
    assert len({id(v) for v in variables}) == len(variables)  # no clone shares a variable

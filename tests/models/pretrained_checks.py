"""What the models' own pretrained tests share (each family's parity on its fixtures is checked
in tests/conformance/): a fixture checkpoint (written by the reference library,
`tests/fixtures/pretrained/make_*.py`) loaded into a zoo model on one device or the (2, 2, 2)
mesh, its logits in float32 at the highest matmul precision, and an export."""

from __future__ import annotations

import importlib.util
import pathlib
import types
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import pytest
from conformance.checks import ONE_DEVICE, RULES, make_mesh, on_mesh
from flax import nnx
from zoo.engine import registry
from zoo.engine.weights import pretrained as weights

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "pretrained"
HAS_REFERENCE = all(importlib.util.find_spec(m) for m in ("torch", "transformers"))
needs_reference = pytest.mark.skipif(not HAS_REFERENCE, reason="needs torch and transformers")


def script(name: str) -> types.ModuleType:
    """A fixture script (`make_resnet`, ...) as a module; importing it needs the reference
    extra (torch, transformers)."""
    spec = importlib.util.spec_from_file_location(name, FIXTURES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference(name: str) -> dict[str, np.ndarray]:
    """The fixture's fixed inputs and the reference library's outputs for them."""
    with np.load(FIXTURES / name / "reference.npz") as npz:
        return dict(npz)


def loaded(
    directory: str | pathlib.Path, mesh: Mapping[str, int] = ONE_DEVICE, **overrides: Any
) -> tuple[nnx.Module, dict[str, Any]]:
    """(model, its hparams): the checkpoint's model (sizes from its config.json, `overrides` on
    top) built abstract (no random init) and filled from the checkpoint onto `mesh`."""
    pretrained = weights.open_pretrained(directory)
    hparams = {**pretrained.hparams(), **overrides}
    entry = registry.get_model(pretrained.family.model)
    with on_mesh(mesh):
        model = nnx.eval_shape(lambda: entry.build(hparams, nnx.Rngs(0)))
    weights.fill(model, pretrained, hparams=hparams, mesh=make_mesh(mesh), rules=RULES)
    model.eval()
    return model, hparams


def logits(model: nnx.Module, images: np.ndarray, mesh: Mapping[str, int] = ONE_DEVICE):
    """The model's eval-mode outputs, float32 at the highest matmul precision, on `mesh`."""
    with on_mesh(mesh), jax.default_matmul_precision("highest"):
        return np.asarray(nnx.jit(lambda m, x: m(x))(model, images))


def exported(model: nnx.Module, hparams: Mapping[str, Any], family, out: pathlib.Path) -> str:
    """The model written back out in `family`'s layout (its config.json and safetensors)."""
    tensors = weights.export_tensors(model, family, hparams)
    return weights.write_pretrained(out, family.export_config(hparams), tensors)


def assert_references_regenerate(maker: str, names: list[str], out: pathlib.Path) -> None:
    """The fixture script `maker` run again writes the committed references of `names`."""
    script(maker).main(out)
    for name in names:
        with np.load(out / name / "reference.npz") as again:
            for key, array in reference(name).items():
                np.testing.assert_allclose(again[key], array, rtol=0, atol=1e-6, err_msg=key)

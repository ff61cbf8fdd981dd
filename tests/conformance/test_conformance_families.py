"""Every checkpoint family of every model, through its fixtures in tests/fixtures/pretrained/
(a checkpoint the reference library wrote, its `config.json` of the family, and
`reference.npz`: inputs and the reference library's `logits` for them): `zoo.load` gives the
reference's outputs (float32, highest matmul precision, 1e-5) on one device and on the 2x2x2
mesh, and `zoo.export` writes the checkpoint back bit for bit (a tensor stored quantized, such
as gpt-oss's MXFP4 experts, as its family decodes it), which loads back bit-identical.

A fixture belongs to the family whose `matches` takes its `config.json`; its inputs are the
entry of `reference.npz` besides `logits` whose name has no underscore (`images`, `tokens`;
prefixed pairs such as `gray_images` / `gray_logits` are for the model's own tests)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from conformance.checks import MESH, tiny_models, zoo_models
from flax import nnx
from helpers import ROOT
from safetensors.numpy import load_file
from zoo.engine import registry
from zoo.engine.weights import pretrained as weights

import zoo

FIXTURES = ROOT / "tests" / "fixtures" / "pretrained"


def fixtures_of(family: registry.Family) -> list[Path]:
    """The fixture directories of `family` that hold reference outputs."""
    return [
        directory
        for directory in sorted(FIXTURES.iterdir())
        if (directory / "reference.npz").is_file()
        and family.matches(json.loads((directory / "config.json").read_text()))
    ]


FAMILIES = [f for name in tiny_models() for f in registry.families(name) if f.by_default]
"""Those a checkpoint loads by (a family that loads only when its model is named is tested
with its model's own tests)."""
CHECKPOINTS = [(family, directory) for family in FAMILIES for directory in fixtures_of(family)]


def test_every_family_of_zoo_has_a_fixture():
    ours = [family for family in FAMILIES if family.model in zoo_models()]
    assert ours and all(fixtures_of(family) for family in ours)


def reference(directory: Path) -> tuple[np.ndarray, np.ndarray]:
    """The fixture's inputs and the reference library's logits for them."""
    with np.load(directory / "reference.npz") as npz:
        (inputs,) = [key for key in npz if key != "logits" and "_" not in key]
        return npz[inputs], npz["logits"]


@pytest.fixture(scope="module", params=CHECKPOINTS, ids=lambda c: f"{c[0].name}-{c[1].name}")
def checkpoint(request) -> tuple[registry.Family, Path, zoo.TrainedModel]:
    """(family, fixture directory, the checkpoint loaded on one device)."""
    family, directory = request.param
    return family, directory, zoo.load(directory, devices=jax.devices()[:1])


def assert_gives_the_reference_outputs(trained: zoo.TrainedModel, directory: Path) -> None:
    inputs, logits = reference(directory)
    with jax.default_matmul_precision("highest"):
        out = zoo.predict(trained, inputs)
    assert out.shape[:-1] == logits.shape[:-1] and out.shape[-1] >= logits.shape[-1]
    np.testing.assert_allclose(out[..., : logits.shape[-1]], logits, rtol=0, atol=1e-5)


def test_loads_with_the_reference_outputs_on_one_device(checkpoint):
    family, directory, trained = checkpoint
    assert trained.config.model.name == family.model
    assert_gives_the_reference_outputs(trained, directory)


def test_loads_with_the_reference_outputs_on_the_mesh(checkpoint):
    _, directory, _ = checkpoint
    assert_gives_the_reference_outputs(zoo.load(directory, mesh=MESH), directory)


def test_exports_back_bit_for_bit(checkpoint, tmp_path):
    """Every tensor of the checkpoint that is a param (not one its family ignores) is written
    back as the reader reads it (`tensors()`: as stored, or decoded in float32 where the
    family combines quantized parts, which the export writes unquantized), and the export
    loads back bit-identical."""
    family, directory, trained = checkpoint
    out = Path(zoo.export(directory, tmp_path / "out", format="hf"))
    written, source = load_file(out / "model.safetensors"), weights.open_pretrained(directory)
    params = {
        key: array
        for key, array in source.tensors()
        if not any(re.fullmatch(pattern, key) for pattern in family.ignore)
    }
    assert sorted(written) == sorted(params)
    for key, array in params.items():
        np.testing.assert_array_equal(written[key], array, err_msg=key)
    again = zoo.load(out, devices=jax.devices()[:1])
    before, after = (nnx.to_flat_state(nnx.state(t.model)) for t in (trained, again))
    assert [path for path, _ in after] == [path for path, _ in before]
    for (path, x), (_, y) in zip(before, after, strict=True):
        np.testing.assert_array_equal(np.asarray(y[...]), np.asarray(x[...]), str(path))

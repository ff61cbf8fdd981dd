"""GPT-2 checkpoints written by transformers (the family's parity on its fixture, on one device
and the 2x2x2 mesh, and its export: tests/conformance/): a checkpoint sharded over several
files loads as exactly, each param into its own blocks of host memory; scanned layers load and
export per layer; the export carries the tokenizer; bad directories are refused with their
fault named."""

from __future__ import annotations

import json
import shutil
import sys

import jax
import numpy as np
import pytest
from conformance.checks import ONE_DEVICE
from helpers import ROOT
from pretrained_checks import loaded
from pretrained_checks import logits as pretrained_logits
from zoo.engine.weights import pretrained as weights

import zoo
from zoo.exporting import export
from zoo.loading import checkpoint_hparams, plan_pretrained

FIXTURES = ROOT / "tests" / "fixtures" / "pretrained"
TINY, SHARDED = FIXTURES / "gpt2-tiny", FIXTURES / "gpt2-tiny-sharded"
REFERENCE = np.load(TINY / "reference.npz")
VOCAB = 300


def logits(directory, mesh=None) -> np.ndarray:
    devices = None if mesh else jax.devices()[:1]
    trained = zoo.load(directory, mesh=mesh, devices=devices)
    with jax.default_matmul_precision("highest"):
        return zoo.predict(trained, REFERENCE["tokens"])


@pytest.mark.parametrize("mesh", [None, {"data": 2, "fsdp": 2, "tensor": 2}], ids=["1", "2x2x2"])
def test_a_sharded_checkpoint_matches_transformers(mesh):
    out = logits(SHARDED, mesh)
    assert out.shape[-1] == VOCAB  # the padded rows' masked logits are left out
    np.testing.assert_allclose(out, REFERENCE["logits"], atol=1e-5, rtol=0)


def test_each_device_holds_the_block_of_the_host_buffer_the_fill_copied_into():
    """On the 2x2x2 mesh (params sharded one, two and three ways, padded rows among them),
    jax adopted each param's host buffer block by block: no second copy."""
    pretrained = weights.open_pretrained(TINY)
    mesh = {"data": 2, "fsdp": 2, "tensor": 2}
    planned = plan_pretrained(pretrained, checkpoint_hparams(pretrained), mesh, None)
    fill = planned.plan_fill()
    fill.copy()
    fill.place()
    for path, filling in fill.fillings.items():
        blocks = {filling.block(n).ctypes.data for n in range(len(filling.blocks))}
        shards = fill.targets[path][...].addressable_shards
        assert {shard.data.unsafe_buffer_pointer() for shard in shards} == blocks, path
    assert {len(f.blocks) for f in fill.fillings.values()} == {1, 2, 4}


def test_references_regenerate_live(tmp_path):
    pytest.importorskip("transformers")
    sys.path.insert(0, str(FIXTURES))
    import make_gpt2

    make_gpt2.main(tmp_path)
    live = np.load(tmp_path / "gpt2-tiny" / "reference.npz")
    np.testing.assert_array_equal(live["tokens"], REFERENCE["tokens"])
    np.testing.assert_allclose(live["logits"], REFERENCE["logits"], atol=1e-6, rtol=0)


def test_the_export_carries_the_tokenizer(tmp_path):
    export(TINY, tmp_path / "out", format="hf")
    copied = (tmp_path / "out" / "tokenizer.json").read_bytes()
    assert copied == (TINY / "tokenizer.json").read_bytes()


def test_exported_directory_loads_in_transformers(tmp_path):
    pytest.importorskip("transformers")
    import torch
    from transformers import GPT2LMHeadModel

    out = export(TINY, tmp_path / "out", format="hf")
    reference = GPT2LMHeadModel.from_pretrained(out).eval()
    with torch.no_grad():
        live = reference(torch.from_numpy(REFERENCE["tokens"]).long()).logits.numpy()
    np.testing.assert_allclose(live, REFERENCE["logits"], atol=1e-5, rtol=0)


def copy_of(tmp_path, source=TINY):
    target = tmp_path / source.name
    shutil.copytree(source, target)
    return target


def test_a_directory_of_another_family_is_refused(tmp_path):
    directory = copy_of(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    with pytest.raises(zoo.ZooError, match="'gpt_neox'.*no registered family.*gpt2"):
        zoo.load(directory)


def test_a_missing_shard_is_named(tmp_path):
    directory = copy_of(tmp_path, SHARDED)
    (directory / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(zoo.ZooError, match="lacks shard.*model-00002-of-00003.safetensors"):
        zoo.load(directory)


def test_a_truncated_file_is_named(tmp_path):
    directory = copy_of(tmp_path)
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(zoo.ZooError, match="model.safetensors.*truncated or damaged"):
        zoo.load(directory)


def test_a_tokenizer_of_another_vocabulary_is_refused(tmp_path):
    directory = copy_of(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "vocab_size": 256}))
    with pytest.raises(zoo.ZooError, match="300 ids, more than.*model.vocab_size=256"):
        zoo.load(directory)


def test_a_key_that_maps_nowhere_and_an_unfilled_param_are_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    directory = copy_of(tmp_path)
    tensors = load_file(directory / "model.safetensors")
    tensors["transformer.extra.weight"] = tensors.pop("transformer.ln_f.bias")
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        zoo.ZooError, match=r"transformer.extra.weight.*no checkpoint key fills: norm.bias"
    ):
        zoo.load(directory)


@pytest.mark.parametrize(
    "mesh", [ONE_DEVICE, {"data": 2, "fsdp": 2, "tensor": 2}], ids=["1", "2x2x2"]
)
def test_scanned_layers_load_each_layer_into_its_slice(mesh):
    scanned, hparams = loaded(TINY, mesh, scan_layers=True)
    assert scanned.blocks.attention.query.kernel.shape[0] == 2  # one stacked module
    tokens = np.concatenate([REFERENCE["tokens"]] * 2)  # a batch that splits 4 ways
    out = pretrained_logits(scanned, tokens, mesh)[: len(REFERENCE["tokens"])]
    np.testing.assert_allclose(out[..., :VOCAB], REFERENCE["logits"], atol=1e-5, rtol=0)
    family = weights.open_pretrained(TINY).family
    per_layer, plain_hparams = loaded(TINY)
    back = weights.export_tensors(scanned, family, hparams)
    plain = weights.export_tensors(per_layer, family, plain_hparams)
    assert back.keys() == plain.keys()
    for key in plain:
        np.testing.assert_array_equal(back[key], plain[key], err_msg=key)


def test_a_layer_missing_from_a_scanned_model_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    directory = copy_of(tmp_path)
    tensors = load_file(directory / "model.safetensors")
    del tensors["transformer.h.1.ln_2.bias"]
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        zoo.ZooError, match=r"no checkpoint key fills: blocks.mlp_norm.bias \(layer"
    ):
        loaded(directory, scan_layers=True)


def test_tensors_read_as_the_safetensors_library_reads_them(tmp_path):
    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    directory = copy_of(tmp_path)
    tensors = load_file(directory / "model.safetensors")
    tensors["transformer.wpe.weight"] = tensors["transformer.wpe.weight"].astype(np.float16)
    tensors["transformer.wte.weight"] = tensors["transformer.wte.weight"].astype(ml_dtypes.bfloat16)
    tensors["transformer.ln_f.bias"] = tensors["transformer.ln_f.bias"][:0]  # empty
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    read = dict(weights.open_pretrained(directory).tensors())
    expected = load_file(directory / "model.safetensors")
    assert read.keys() == expected.keys()
    for key, array in expected.items():
        assert read[key].dtype == array.dtype and read[key].shape == array.shape, key
        np.testing.assert_array_equal(read[key], array, err_msg=key)

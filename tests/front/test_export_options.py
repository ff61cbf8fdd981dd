"""`zoo.export(..., format="hf")`'s options on the tiny GPT-2 checkpoint: weights written in
bfloat16 (a bf16 file, loading back as the params rounded to bf16), split into shards above a
size (an index as transformers writes it, loading back bit-identical), and the source
directory's tokenizer files, chat template and generation config carried into the export."""

from __future__ import annotations

import importlib
import json
import logging
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from helpers import ROOT
from omegaconf import OmegaConf
from zoo.engine.weights import pretrained as weights

import zoo
from zoo import hf_export

zoo_export = importlib.import_module("zoo.export")  # the command (`zoo.export`: the function)
TINY = ROOT / "tests" / "fixtures" / "pretrained" / "gpt2-tiny"
ONE = jax.devices()[:1]
EXTRAS = {
    "tokenizer_config.json": '{"model_max_length": 64}',
    "special_tokens_map.json": '{"eos_token": "<|endoftext|>"}',
    "generation_config.json": '{"max_new_tokens": 8, "eos_token_id": 0}',
    "chat_template.jinja": "{% for m in messages %}{{ m.content }}{% endfor %}",
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The tiny GPT-2 with the tokenizer settings, chat template and generation config that a
    hub checkpoint has beside its weights."""
    directory = tmp_path_factory.mktemp("source") / "gpt2"
    shutil.copytree(TINY, directory)
    for name, text in EXTRAS.items():
        (directory / name).write_text(text)
    return directory


@pytest.fixture(scope="module")
def params(source):
    return flat_params(zoo.load(source, devices=ONE))


def flat_params(trained) -> dict[str, np.ndarray]:
    return {
        ".".join(map(str, path)): np.asarray(variable[...])
        for path, variable in nnx.to_flat_state(nnx.state(trained.model, nnx.Param))
    }


def header(path) -> dict[str, dict]:
    """A safetensors file's tensors: key -> dtype, shape and offsets."""
    data = path.read_bytes()
    entries = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    return {key: entry for key, entry in entries.items() if key != "__metadata__"}


def dtypes(path) -> set[str]:
    return {entry["dtype"] for entry in header(path).values()}


def test_a_bf16_export_loads_back_as_the_params_rounded_to_bf16(source, params, tmp_path):
    out = tmp_path / "bf16"
    zoo.export(source, out, dtype="bfloat16")
    assert dtypes(out / "model.safetensors") == {"BF16"}
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"  # transformers 5's and 4's
    again = flat_params(zoo.load(out, devices=ONE))
    assert sorted(again) == sorted(params)
    for path, value in params.items():
        rounded = value.astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(again[path], rounded, err_msg=path)
        assert again[path].dtype == np.float32


def test_a_sharded_export_loads_back_bit_identical(source, params, tmp_path):
    out = tmp_path / "sharded"
    zoo.export(source, out, max_shard_size="100KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and not (out / "model.safetensors").exists()
    assert shards == [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, 1 + len(shards))
    ]
    sizes = [(out / shard).stat().st_size for shard in shards]
    assert max(sizes) < 100_000 + 4096  # the tensors (none over 100 KB) and a header
    source_keys = set(weights.open_pretrained(source).files)
    assert set(index["weight_map"]) == source_keys - {"lm_head.weight"}
    entries = [entry for shard in shards for entry in header(out / shard).values()]
    assert index["metadata"]["total_size"] == sum(4 * np.prod(e["shape"]) for e in entries)
    again = flat_params(zoo.load(out, devices=ONE))
    for path, value in params.items():
        np.testing.assert_array_equal(again[path], value, err_msg=path)


def test_a_shard_size_above_the_weights_writes_one_file(source, tmp_path):
    out = tmp_path / "one"
    zoo_export.main([str(source), str(out), "max_shard_size=1GB", "dtype=bfloat16"])
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]


def test_the_tokenizer_files_and_generation_config_are_carried(source, tmp_path):
    out = tmp_path / "carried"
    zoo.export(source, out)
    for name in ("tokenizer.json", *EXTRAS):
        assert (out / name).read_bytes() == (source / name).read_bytes(), name


def test_a_run_trained_with_another_tokenizer_carries_that_one_alone(source, tmp_path):
    other = tmp_path / "other.json"
    shutil.copyfile(source / "tokenizer.json", other)
    config = OmegaConf.create(
        {"finetune": {"init_from": str(source)}, "data": {"tokenizer": str(other)}}
    )
    assert hf_export.carried_files(config) == {"tokenizer.json": str(other)}
    config.data.tokenizer = str(source / "tokenizer.json")
    assert set(hf_export.carried_files(config)) == {"tokenizer.json", *EXTRAS}


@pytest.mark.parametrize(
    "options, named",
    [
        ({"dtype": "float16"}, "dtype='float16'"),
        ({"max_shard_size": "lots"}, "max_shard_size='lots'"),
        ({"format": "jax", "dtype": "bfloat16"}, "options of format=hf"),
    ],
)
def test_bad_export_options_are_refused_by_name(source, tmp_path, options, named):
    with pytest.raises(zoo.ZooError, match=named):
        zoo.export(source, tmp_path / "out", **options)
    assert not (tmp_path / "out").exists()


def test_a_source_directory_that_is_gone_is_said(tmp_path, caplog):
    config = OmegaConf.create({"finetune": {"init_from": str(tmp_path / "gone")}, "data": {}})
    with caplog.at_level(logging.WARNING, logger="zoo"):
        assert hf_export.carried_files(config) == {}
    assert f"started from {tmp_path / 'gone'}, which is gone" in caplog.text


def test_a_decoder_trained_here_is_written_as_the_family_that_holds_its_settings(tmp_path):
    sizes = ("model.dim=32", "model.depth=2", "model.num_heads=2", "model.context_length=16")
    quick = ("data.window=16", "data.eval_bytes=2048", "trainer.steps=1", "trainer.eval_every=1")
    run = zoo.fit("decoder", *sizes, "model.qk_norm=true", *quick, f"workdir={tmp_path / 'run'}")
    out = zoo.export(run.workdir, tmp_path / "hf", format="hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "qwen3"  # llama, first to hold the defaults, has no q/k norm
    exported, trained = flat_params(zoo.load(out, devices=ONE)), flat_params(run)
    assert exported.keys() == trained.keys()
    for path, value in trained.items():
        np.testing.assert_array_equal(exported[path], value, err_msg=path)


MIXED = "[sliding_attention,full_attention]"


@pytest.mark.parametrize(
    ("options", "model_type"),
    [
        ((), "llama"),  # the defaults: the first family whose layout holds them
        (("model.qk_norm=true",), "qwen3"),
        (("model.sliding_window=8",), "mistral"),  # every layer sliding
        (("model.qkv_bias=true", "model.sliding_window=8", f"model.layer_types={MIXED}"), "qwen2"),
        (("model.sliding_window=8", f"model.layer_types={MIXED}"), None),  # no layout holds it
    ],
)
def test_the_family_written_is_the_first_whose_layout_holds_the_settings(options, model_type):
    config = zoo.compose(["model=decoder", "model.depth=2", *options])
    trained = zoo.TrainedModel(None, config, 0, None, None, None, {})
    if model_type is None:
        with pytest.raises(zoo.ZooError, match="No checkpoint family of model 'decoder' has a"):
            hf_export.export_family(trained)
    else:
        assert hf_export.export_family(trained).name == model_type

"""Llama, Qwen 2, Qwen 3, Mistral and Gemma 3 checkpoints written by transformers
(`tests/fixtures/pretrained/make_decoders.py`), loaded into `decoder`. Their logits on one device
and on the 2x2x2 mesh, and their export back bit for bit, are checked with every family's in
tests/conformance/; here: transformers' greedy continuations, scanned layers on the mesh (both
layer types in one scan) loading and exporting per layer, the export's config (transformers 5's
layout, with transformers 4's keys beside it) reading back to the same model, both config.json
layouts giving the same model, every key of the fixtures' and of published checkpoints' configs
accounted for, and each setting decoder does not implement refused by name."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import math
import pathlib
import shutil
import weakref

import jax
import numpy as np
import pytest
from conformance.checks import MESH
from flax import nnx
from pretrained_checks import (
    FIXTURES,
    assert_references_regenerate,
    needs_reference,
    reference,
    script,
)
from safetensors.numpy import save_file
from zoo.engine import registry
from zoo.engine.sharding import mesh as sharding
from zoo.engine.weights import pretrained as weights
from zoo.models.experts import PROJECTIONS, mixture_layers
from zoo.models.language_model import language_model_loss
from zoo.models.text_completion import generate_tokens

import zoo
from benchmarks import decoder_costs
from zoo.loading import checkpoint_hparams, plan_pretrained

DECODER_FAMILIES = {family.name: family for family in registry.families("decoder")}
NAMES = sorted(
    directory.name
    for directory in FIXTURES.iterdir()
    if (directory / "reference.npz").is_file()
    and json.loads((directory / "config.json").read_text()).get("model_type") in DECODER_FAMILIES
)
as_transformers_4 = script("config_layouts").as_transformers_4


def config_of(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def family_of(config: dict) -> registry.Family:
    return DECODER_FAMILIES[config["model_type"]]


def test_each_family_and_option_has_a_fixture():
    configs = [config_of(name) for name in NAMES]
    assert {c["model_type"] for c in configs} == set(DECODER_FAMILIES)
    hparams = [family_of(c).hparams(c) for c in configs]
    seen = {
        "gqa": any(1 < h["num_kv_heads"] < h["num_heads"] for h in hparams),
        "mqa": any(h["num_kv_heads"] == 1 for h in hparams),
        "tied": any(h["tie_embeddings"] for h in hparams),
        "separate": any(not h["tie_embeddings"] for h in hparams),
        "qk_norm": any(h["qk_norm"] and not h["post_norms"] for h in hparams),
        "biases": any(h["qkv_bias"] and not h["out_bias"] for h in hparams),
        "rope": {h["rope_type"] for h in hparams} == {"default", "linear", "llama3", "yarn"},
        "sinks": any(h.get("attention_sinks") for h in hparams),
        "biased experts": any(h["num_experts"] and h["mlp_bias"] for h in hparams),
        "latent": {bool(h["q_lora_rank"]) for h in hparams if h["kv_lora_rank"]} == {True, False},
        "grouped sigmoid routing": any(
            1 < h["router_groups_kept"] < h["router_groups"] and h["shared_expert_mlp_dim"]
            for h in hparams
        ),
        "local_rope": any(h["local_rope_theta"] for h in hparams),
        "window": any(0 < h["sliding_window"] < 16 and not h["layer_types"] for h in hparams),
        "pattern": any(len(set(h["layer_types"] or ())) == 2 for h in hparams),
        "layouts": {"rope_parameters" in c for c in configs} == {True, False},
        "sharded": any((FIXTURES / n / weights.INDEX).is_file() for n in NAMES),
        "bf16": any(c.get("dtype", c.get("torch_dtype")) == "bfloat16" for c in configs),
    }
    assert all(seen.values()), seen


@pytest.fixture(scope="module", params=NAMES)
def checkpoint(request) -> tuple[str, zoo.TrainedModel]:
    return request.param, zoo.load(FIXTURES / request.param, devices=jax.devices()[:1])


def test_greedy_continuation_equals_transformers(checkpoint):
    name, trained = checkpoint
    expected = reference(name)
    with trained.activate(), jax.default_matmul_precision("highest"):
        new = generate_tokens(
            trained.model, expected["prompt_tokens"], len(expected["greedy_tokens"]), 0.0
        )
    np.testing.assert_array_equal(new, expected["greedy_tokens"])


MIXTURES = [
    name for name in NAMES if family_of(config_of(name)).hparams(config_of(name))["num_experts"]
]
"""The fixtures whose layers hold mixtures of experts."""
EXPERT_MESHES = {
    "expert2-fsdp2-data2": {"data": 2, "fsdp": 2, "expert": 2},
    "expert4-tensor2": {"data": 1, "expert": 4, "tensor": 2},
}
"""Meshes of 8 devices that split the experts (expert parallelism), with FSDP or tensor
parallelism beside it: the fixtures hold 4 or 8 experts."""


@pytest.mark.parametrize("mesh", EXPERT_MESHES.values(), ids=EXPERT_MESHES)
@pytest.mark.parametrize("name", MIXTURES)
def test_experts_split_over_devices_give_transformers_logits_and_continuation(name, mesh):
    """Each device holds its share of the experts; a layer's tokens are exchanged between the
    devices of its expert group and its outputs come back to their devices: the logits are
    transformers' (float32, 1e-5). A prompt of one, whose batch no axis splits, is computed by
    every expert device with its experts and the outputs summed: the greedy continuation is
    transformers'."""
    trained = zoo.load(FIXTURES / name, mesh=mesh)
    expected = reference(name)
    with jax.default_matmul_precision("highest"):
        logits = zoo.predict(trained, expected["tokens"])
        with trained.activate():
            new = generate_tokens(
                trained.model, expected["prompt_tokens"], len(expected["greedy_tokens"]), 0.0
            )
    vocab = expected["logits"].shape[-1]
    np.testing.assert_allclose(logits[..., :vocab], expected["logits"], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(new, expected["greedy_tokens"])


@pytest.mark.parametrize("ways", [2, 4])
def test_each_expert_device_holds_its_share_of_the_experts(ways):
    """With `expert=N` (and no other axis splitting params), every device holds 1/N of every
    stacked expert param, kernels and biases (gpt-oss's), by the bytes its shards take."""
    trained = zoo.load(FIXTURES / "gpt-oss-tiny", mesh={"data": 8 // ways, "expert": ways})
    for path, variable in nnx.to_flat_state(nnx.state(trained.model, nnx.Param)):
        if "experts" not in path:
            continue
        value = variable[...]
        held = {shard.data.nbytes for shard in value.addressable_shards}
        assert held == {value.nbytes // ways}, (path, held, value.nbytes)


@pytest.mark.parametrize(
    "name, mesh, message",
    [
        ("llama-tiny", {"data": 4, "expert": 2}, r"mesh.expert=2 splits the experts .* has none"),
        ("qwen3-moe-tiny", {"data": 1, "expert": 8}, r"\['expert'\] cannot split 8 ways"),
    ],
    ids=["no experts", "indivisible"],
)
def test_an_expert_axis_that_cannot_split_the_experts_is_refused_by_name(name, mesh, message):
    with pytest.raises(zoo.ZooError, match=message):
        zoo.load(FIXTURES / name, mesh=mesh)


@pytest.mark.parametrize("name", MIXTURES)
def test_scanned_layers_of_experts_are_refused_by_name(name):
    pretrained = weights.open_pretrained(FIXTURES / name)
    hparams = {**checkpoint_hparams(pretrained), "scan_layers": True}
    with pytest.raises(zoo.ZooError, match="model.scan_layers=false"):
        plan_pretrained(pretrained, hparams, MESH, None).fill()


def test_lora_on_gpt_oss_experts_merges_into_their_kernels():
    """Adapters on gpt-oss's experts, whose biases and clamped SwiGLU sit beside the kernels:
    merged into the kernels, the model computes what the adapted one does."""
    trained = zoo.load(FIXTURES / "gpt-oss-tiny", devices=jax.devices()[:1])
    tokens = reference("gpt-oss-tiny")["tokens"]
    experts = [mixture.experts for mixture in mixture_layers(trained.model).values()]
    forward = nnx.jit(lambda model: model(tokens))  # whole passes compile faster than op by op
    with trained.activate(), jax.default_matmul_precision("highest"):
        plain = np.asarray(forward(trained.model))
        for i, module in enumerate(experts):
            module.add_lora(2, nnx.Rngs(i))
            for name in PROJECTIONS:
                b = getattr(module, f"{name}_lora_b")
                b[...] = 0.1 * jax.random.normal(jax.random.key(i), b.shape)
        adapted = np.asarray(forward(trained.model))
        for module in experts:
            module.merge_lora()
        merged = np.asarray(forward(trained.model))
    assert np.abs(adapted - plain).max() > 1e-2  # the adapters change the experts
    np.testing.assert_allclose(merged, adapted, rtol=0, atol=1e-5)


def test_deepseek_multi_token_prediction_layers_are_ignored(tmp_path):
    """A DeepSeek V3 checkpoint's multi-token-prediction layer, stored after its last layer
    (`model.layers.<num_hidden_layers>.*`, as the hub's layer 61), is not loaded, as
    transformers loads none: the model is the checkpoint's layers' alone."""
    directory = tmp_path / "deepseek-v3-mtp"
    shutil.copytree(FIXTURES / "deepseek-v3-tiny", directory)
    tensors = dict(weights.open_pretrained(directory).tensors())
    depth = config_of("deepseek-v3-tiny")["num_hidden_layers"]
    for key in [k for k in tensors if k.startswith("model.layers.0.")]:
        tensors[key.replace("layers.0.", f"layers.{depth}.")] = np.ones_like(tensors[key])
    tensors[f"model.layers.{depth}.eh_proj.weight"] = np.ones((32, 64), np.float32)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    (directory / "config.json").write_text(
        json.dumps({**config_of("deepseek-v3-tiny"), "num_nextn_predict_layers": 1})
    )
    trained = zoo.load(directory, devices=jax.devices()[:1])
    expected = reference("deepseek-v3-tiny")
    with jax.default_matmul_precision("highest"):
        out = zoo.predict(trained, expected["tokens"])
    vocab = expected["logits"].shape[-1]
    np.testing.assert_allclose(out[..., :vocab], expected["logits"], rtol=0, atol=1e-5)


MXFP4 = "gpt-oss-mxfp4"
"""gpt-oss as the hub stores it: its experts in MXFP4 (`_blocks` and `_scales`)."""
MXFP4_KEY = "model.layers.{layer}.mlp.experts.{name}_proj"


def test_mxfp4_experts_load_exactly_in_bfloat16_and_float32():
    """Every MXFP4 value is a bfloat16 number: the experts decoded into bfloat16 params are the
    float32 load's, bit for bit, and both the decoded tensors of the checkpoint."""
    source = dict(weights.open_pretrained(FIXTURES / MXFP4).tensors())
    loads = [
        zoo.load(FIXTURES / MXFP4, devices=jax.devices()[:1], model={"param_dtype": dtype})
        for dtype in ("fp32", "bf16")
    ]
    for layer, mixture in enumerate(mixture_layers(loads[0].model).values()):
        gate_up = source[MXFP4_KEY.format(layer=layer, name="gate_up")]
        np.testing.assert_array_equal(mixture.experts.gate[...], gate_up[..., ::2].swapaxes(1, 2))
    full, low = (nnx.state(t.model, nnx.Param) for t in loads)
    for kept, rounded in zip(jax.tree.leaves(full), jax.tree.leaves(low), strict=True):
        assert rounded.dtype == jax.numpy.bfloat16
        np.testing.assert_array_equal(np.asarray(rounded, np.float32), np.asarray(kept))


def test_mxfp4_tensors_are_decoded_one_at_a_time(monkeypatch):
    """Each tensor stored in MXFP4 is decoded once, after the plain tensors are copied, and let
    go before the next is decoded: the host holds one decoded tensor besides the model."""
    live: list[weakref.ref] = []
    decode = weights._Encoded.decode

    def watched(self, dtype):
        assert all(ref() is None for ref in live), "a decoded tensor is still held"
        decoded = decode(self, dtype)
        live.append(weakref.ref(decoded.base))
        return decoded

    monkeypatch.setattr(weights._Encoded, "decode", watched)
    pretrained = weights.open_pretrained(FIXTURES / MXFP4)
    planned = plan_pretrained(pretrained, checkpoint_hparams(pretrained), MESH, None)
    fill = planned.plan_fill()
    assert not live  # planning decodes nothing
    fill.copy()
    assert len(live) == len(pretrained.combined) == 4  # 2 layers x (gate_up, down)


def mxfp4_copy(tmp_path, tensors=None, **config) -> pathlib.Path:
    """A copy of the MXFP4 fixture with `tensors(dict of key -> array)` edited in place (the
    rest rewritten in float32, which holds the file's bfloat16 exactly) and `config` set."""
    directory = tmp_path / MXFP4
    shutil.copytree(FIXTURES / MXFP4, directory)
    if tensors is not None:
        stored = {
            key: np.asarray(array, np.float32) if array.dtype != np.uint8 else np.asarray(array)
            for key, array in weights.open_pretrained(directory)._views()
        }
        tensors(stored)
        save_file(stored, directory / "model.safetensors", metadata={"format": "pt"})
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return directory


def without_scales(tensors):
    del tensors[MXFP4_KEY.format(layer=1, name="down") + "_scales"]


def with_a_group_too_many(tensors):
    key = MXFP4_KEY.format(layer=0, name="gate_up") + "_scales"
    tensors[key] = np.concatenate([tensors[key]] * 2, axis=-1)


def with_signed_blocks(tensors):
    key = MXFP4_KEY.format(layer=0, name="down") + "_blocks"
    tensors[key] = tensors[key].view(np.int8)


@pytest.mark.parametrize(
    ("change", "config", "named"),
    [
        (
            without_scales,
            {},
            (
                r"holds model\.layers\.1\.mlp\.experts\.down_proj_blocks without "
                r"model\.layers\.1\.mlp\.experts\.down_proj_scales"
            ),
        ),
        (
            with_a_group_too_many,
            {},
            (
                r"model\.layers\.0\.mlp\.experts\.gate_up_proj \(.*_scales \[4, 128, 2\] "
                r"uint8\) does not fit: the blocks have shape \[4, 128, 1, 16\] and the "
                r"scales \[4, 128, 2\]"
            ),
        ),
        (
            with_signed_blocks,
            {},
            r"model\.layers\.0\.mlp\.experts\.down_proj .*bytes \(U8\), and these are int8",
        ),
        (
            None,
            {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
            r"quantization_config with quant_method='fp8'.*with quant_method 'mxfp4'",
        ),
    ],
    ids=["blocks without scales", "scales that do not fit", "signed blocks", "unknown method"],
)
def test_an_mxfp4_checkpoint_that_does_not_fit_is_refused_before_anything_is_built(
    tmp_path, monkeypatch, change, config, named
):
    directory = mxfp4_copy(tmp_path, change, **config)
    monkeypatch.setattr("zoo.loading.abstract_model", lambda *_: pytest.fail("a model was built"))
    with pytest.raises(zoo.ZooError, match=named):
        zoo.load(directory, devices=jax.devices()[:1])


def test_mxfp4_experts_of_another_count_are_refused_by_key(tmp_path):
    """Blocks and scales that fit each other but not the model the config implies: the fill's
    refusal, before the model changes, names the decoded tensor and both shapes."""

    def one_expert_less(tensors):
        for part in ("_blocks", "_scales"):
            key = MXFP4_KEY.format(layer=0, name="down") + part
            tensors[key] = tensors[key][:3]

    directory = mxfp4_copy(tmp_path, one_expert_less)
    with pytest.raises(
        zoo.ZooError,
        match=r"layers\.0\.mlp\.experts\.down \(from model\.layers\.0\.mlp\.experts\."
        r"down_proj: \(3, 32, 64\), model \(4, 32, 64\)\)",
    ):
        zoo.load(directory, devices=jax.devices()[:1])


SOFTMAX_ROUTED = [
    name
    for name in MIXTURES
    if family_of(config_of(name)).hparams(config_of(name))["router_softmax"] != "sigmoid"
]
"""The mixtures whose transformers computes a load-balancing loss (DeepSeek V3's, routed by
sigmoid scores, computes none)."""


def router_loss_on(name: str, mesh: dict | None, coef: float) -> np.ndarray:
    """`name`'s language-model loss per sequence with router_aux_loss_coef=`coef`, on `mesh`
    (None: one device), of the reference's padded batch (repeated so that the mesh's batch axes
    split it), its router loss and each mixture layer's load checked."""
    pretrained = weights.open_pretrained(FIXTURES / name)
    hparams = checkpoint_hparams(pretrained)
    expected = reference(name)
    mask = expected["aux_mask"]
    tokens = np.pad(expected["tokens"], ((0, 0), (0, 1)))  # inputs: the reference's tokens
    batch = {"tokens": tokens, "length": mask.sum(-1).astype(np.int32) - 1}
    devices = jax.devices()[:1] if mesh is None else jax.devices()
    if mesh:  # a batch that the batch axes split
        rows = math.prod(mesh.get(axis, 1) for axis in sharding.DEFAULT_RULES["batch"])
        batch = {key: np.concatenate([value] * (rows // 2)) for key, value in batch.items()}
    planned = plan_pretrained(pretrained, {**hparams, "router_aux_loss_coef": coef}, mesh, devices)
    model = planned.fill()
    with sharding.activate(planned.mesh, planned.rules), jax.default_matmul_precision("highest"):
        loss, metrics = nnx.jit(language_model_loss)(model, batch, nnx.Rngs(0))
    np.testing.assert_allclose(
        metrics["router_aux_loss"], expected["router_aux_loss"], rtol=0, atol=1e-5
    )
    loads = [key for key in metrics if key.startswith("expert_load/")]
    assert len(loads) == sum(map(hparams_has_experts(hparams), range(hparams["depth"])))
    assert all(1.0 <= float(np.max(metrics[key])) for key in loads)
    return np.asarray(loss)


@functools.cache
def loss_without_the_router_loss(name: str) -> np.ndarray:
    """`router_loss_on` one device with router_aux_loss_coef=0, computed once for every mesh."""
    return router_loss_on(name, None, 0.0)


@pytest.mark.parametrize(
    "mesh", [None, MESH, *EXPERT_MESHES.values()], ids=["one device", "2x2x2", *EXPERT_MESHES]
)
@pytest.mark.parametrize("name", SOFTMAX_ROUTED)
def test_the_router_loss_is_transformers_and_joins_the_training_loss(name, mesh):
    """With output_router_logits, the language-model loss of a padded batch holds the router's
    load-balancing loss transformers computes (`router_aux_loss`, over the real tokens alone),
    weighted by router_aux_loss_coef; each mixture layer's load is reported beside it. On the
    meshes too, those splitting the experts included: the loss is over every device's tokens,
    and each sequence's is the one on one device without the router's loss (reported there
    too, with coef 0) plus the weighted router loss."""
    plain = loss_without_the_router_loss(name)
    weighted = router_loss_on(name, mesh, 0.25)
    plain = np.tile(plain, len(weighted) // len(plain))  # the mesh's batch: the rows repeated
    np.testing.assert_allclose(
        weighted - plain, 0.25 * reference(name)["router_aux_loss"], rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("mesh", EXPERT_MESHES.values(), ids=EXPERT_MESHES)
def test_gradients_through_the_expert_exchange_are_those_on_one_device(mesh):
    """Training differentiates through the exchange (the gathers' transposes sum each
    device's share): every param's gradient of the loss, router loss included, on a mesh that
    splits the experts is the one on one device (gpt-oss: biased experts too), and so are the
    router loss and each layer's expert load, over every device's tokens."""
    pretrained = weights.open_pretrained(FIXTURES / "gpt-oss-tiny")
    hparams = {**checkpoint_hparams(pretrained), "router_aux_loss_coef": 0.25}
    tokens = np.concatenate([reference("gpt-oss-tiny")["tokens"]] * 4)  # 8 rows: any mesh's
    batch = {"tokens": tokens, "length": np.arange(8, dtype=np.int32) + tokens.shape[1] - 8}

    def total_loss(model):
        loss, metrics = language_model_loss(model, batch, nnx.Rngs(0))
        routing = {k: v for k, v in metrics.items() if k.startswith(("expert_load/", "router"))}
        return loss.sum(), routing

    found = []
    for spec, devices in [(None, jax.devices()[:1]), (mesh, jax.devices())]:
        planned = plan_pretrained(pretrained, hparams, spec, devices)
        model = planned.fill()
        with (
            sharding.activate(planned.mesh, planned.rules),
            jax.default_matmul_precision("highest"),
        ):
            grad, routing = nnx.jit(nnx.grad(total_loss, has_aux=True))(model)
        grads = {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(grad)}
        found.append({**grads, **{key: np.asarray(value) for key, value in routing.items()}})
    one, split = found
    assert one.keys() == split.keys() and "router_aux_loss" in one
    for path, value in one.items():
        np.testing.assert_allclose(split[path], value, rtol=0, atol=1e-5, err_msg=str(path))


def hparams_has_experts(hparams: dict):
    """Whether each layer of a decoder with `hparams` is a mixture of experts."""
    dense = set(hparams.get("dense_layers") or ())
    return lambda layer: bool(hparams["num_experts"]) and layer not in dense


@pytest.mark.parametrize("name", sorted(set(NAMES) - set(MIXTURES)))
def test_scanned_layers_on_the_mesh_load_and_export_per_layer(name):
    """Stacked layers (a Gemma 3 pattern runs both layer types in one scan), loaded as
    `zoo.load` loads onto the 2x2x2 mesh, give transformers' logits and export the checkpoint's
    tensors, key for key."""
    pretrained = weights.open_pretrained(FIXTURES / name)
    hparams = {**checkpoint_hparams(pretrained), "scan_layers": True}
    planned = plan_pretrained(pretrained, hparams, MESH, None)
    model = planned.fill()
    expected = reference(name)
    tokens = np.concatenate([expected["tokens"]] * 2)  # a batch that splits 4 ways
    with sharding.activate(planned.mesh, planned.rules), jax.default_matmul_precision("highest"):
        out = np.asarray(nnx.jit(lambda m, x: m(x))(model, tokens))[: len(expected["tokens"])]
    vocab = expected["logits"].shape[-1]
    np.testing.assert_allclose(out[..., :vocab], expected["logits"], atol=1e-5, rtol=0)
    exported = weights.export_tensors(model, pretrained.family, hparams)
    source = dict(pretrained.tensors())
    assert sorted(exported) == sorted(source)
    for key, array in source.items():
        np.testing.assert_array_equal(exported[key], array, err_msg=key)


@pytest.mark.parametrize("name", NAMES)
def test_the_exported_config_reads_back_the_same(name):
    config = config_of(name)
    family = family_of(config)
    hparams = family.hparams(config)
    exported = family.export_config(hparams)
    assert "rope_parameters" in exported
    assert "quantization_config" not in exported  # written unquantized, MXFP4's decoded
    assert family.hparams(exported) == hparams
    assert family.unaccounted(exported) == {}


@pytest.mark.parametrize("name", NAMES)
def test_the_exported_config_carries_the_keys_transformers_4_reads(name):
    """Beside transformers 5's `rope_parameters` (and `layer_types`), each key that
    transformers 4 read in their place (`rope_theta`, `rope_scaling`; Gemma 3's
    `rope_local_base_freq`, `sliding_window_pattern`), with the value it wrote there for the
    same model: transformers 4 and vLLM read an export as the model it is, not with their
    default RoPE (checked against transformers 4.57 itself: the fixtures' README)."""
    config = config_of(name)
    family = family_of(config)
    exported = family.export_config(family.hparams(config))
    as_written_by_4 = as_transformers_4(exported)
    del as_written_by_4["transformers_version"]
    assert {key: exported.get(key, "absent") for key in as_written_by_4} == as_written_by_4
    assert family.hparams(as_written_by_4) == family.hparams(exported)


@pytest.mark.parametrize("name", NAMES)
def test_both_config_layouts_give_the_same_model(name):
    config = config_of(name)
    family = family_of(config)
    hparams = family.hparams(config)
    new = config if "rope_parameters" in config else family.export_config(hparams)
    old = as_transformers_4(new)
    assert "rope_parameters" not in old and "rope_theta" in old
    assert family.hparams(new) == family.hparams(old) == hparams


@pytest.mark.parametrize("name", NAMES)
def test_every_key_of_the_fixtures_configs_is_accounted_for(name):
    config = config_of(name)
    family = family_of(config)
    assert family.unaccounted(config) == {}
    assert family.unaccounted({**config, "made_up_key": 1}) == {"made_up_key": 1}


def test_a_key_zoo_does_not_know_is_named_in_a_warning_at_load(tmp_path, caplog):
    directory = tmp_path / "qwen3"
    shutil.copytree(FIXTURES / "qwen3-tiny", directory)
    weights.open_pretrained(directory)
    assert "does not know" not in caplog.text
    config = {**config_of("qwen3-tiny"), "rope_wobble": 0.5}
    (directory / "config.json").write_text(json.dumps(config))
    weights.open_pretrained(directory)
    assert "rope_wobble=0.5" in caplog.text and "qwen3" in caplog.text


# config.json of checkpoints on the hub, as transformers 4 saved them.
PUBLISHED = {
    "Llama-3.2-1B": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.45.0.dev0",
        "use_cache": True,
        "vocab_size": 128256,
    },
    "SmolLM2-135M": {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "hidden_act": "silu",
        "hidden_size": 576,
        "initializer_range": 0.041666666666666664,
        "intermediate_size": 1536,
        "is_llama_config": True,
        "max_position_embeddings": 8192,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 9,
        "num_hidden_layers": 30,
        "num_key_value_heads": 3,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_interleaved": False,
        "rope_scaling": None,
        "rope_theta": 100000,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.40.1",
        "transformers.js_config": {"kv_cache_dtype": {"q4f16": "float16", "fp16": "float16"}},
        "use_cache": True,
        "vocab_size": 49152,
    },
    "Qwen2.5-0.5B-Instruct": {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "hidden_act": "silu",
        "hidden_size": 896,
        "initializer_range": 0.02,
        "intermediate_size": 4864,
        "max_position_embeddings": 32768,
        "max_window_layers": 21,
        "model_type": "qwen2",
        "num_attention_heads": 14,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.43.1",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    "Qwen3-0.6B": decoder_costs.CONFIG,
    "Mistral-7B-v0.1": {
        "architectures": ["MistralForCausalLM"],
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mistral",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.34.0.dev0",
        "use_cache": True,
        "vocab_size": 32000,
    },
    "gemma-3-1b-it": {
        "architectures": ["Gemma3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_logit_softcapping": None,
        "bos_token_id": 2,
        "cache_implementation": "hybrid",
        "eos_token_id": [1, 106],
        "final_logit_softcapping": None,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": 1152,
        "initializer_range": 0.02,
        "intermediate_size": 6912,
        "max_position_embeddings": 32768,
        "model_type": "gemma3_text",
        "num_attention_heads": 4,
        "num_hidden_layers": 26,
        "num_key_value_heads": 1,
        "pad_token_id": 0,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.50.0.dev0",
        "use_cache": True,
        "vocab_size": 262144,
    },
}

PUBLISHED["gpt-oss-20b"] = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 201088,
}

PUBLISHED["DeepSeek-V3"] = {  # its quantization_config (FP8 blocks) left out: refused
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}

# What each published config implies that a misreading would change.
PUBLISHED_HPARAMS = {
    "DeepSeek-V3": {
        "head_dim": 192,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "rope_head_dim": 64,
        "value_head_dim": 128,
        "rope_interleaved": True,
        "rope_type": "yarn",
        "rope_factor": 40.0,
        "rope_original_context": 4096,
        "rope_attention_factor": 1.0,  # mscale / mscale_all_dim
        "rope_mscale_all_dim": 1.0,
        "num_experts": 256,
        "experts_per_token": 8,
        "expert_mlp_dim": 2048,
        "mlp_dim": 18432,
        "shared_expert_mlp_dim": 2048,
        "router_softmax": "sigmoid",
        "router_groups": 8,
        "router_groups_kept": 4,
        "expert_weight_scale": 2.5,
        "normalize_expert_weights": True,
        "dense_layers": [0, 1, 2],
        "tie_embeddings": False,
    },
    "gpt-oss-20b": {
        "num_experts": 32,
        "experts_per_token": 4,
        "expert_mlp_dim": 2880,
        "sliding_window": 128,
        "attention_sinks": True,
        "qkv_bias": True,
        "out_bias": True,
        "mlp_bias": True,
        "router_bias": True,
        "router_softmax": "chosen",
        "activation": "clamped_swiglu",
        "swiglu_limit": 7.0,
        "swiglu_alpha": 1.702,
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "rope_factor": 32.0,
        "rope_original_context": 4096,
        "rope_truncate": False,
        "router_aux_loss_coef": 0.0,  # output_router_logits is false
    },
    "Llama-3.2-1B": {
        "head_dim": 64,
        "num_kv_heads": 8,
        "tie_embeddings": True,
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "rope_factor": 32.0,
        "rope_original_context": 8192,
    },
    "SmolLM2-135M": {"head_dim": 64, "num_kv_heads": 3, "rope_theta": 100000.0},
    "Qwen2.5-0.5B-Instruct": {
        "head_dim": 64,
        "qkv_bias": True,
        "out_bias": False,
        "sliding_window": 0,
        "layer_types": None,
    },
    "Qwen3-0.6B": {"head_dim": 128, "qk_norm": True, "qkv_bias": False, "sliding_window": 0},
    "Mistral-7B-v0.1": {"sliding_window": 4096, "layer_types": None, "tie_embeddings": False},
    "gemma-3-1b-it": {
        "num_kv_heads": 1,
        "query_scale": 256.0,
        "local_rope_theta": 10000.0,
        "rope_theta": 1000000.0,
        "sliding_window": 512,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 4
        + ["sliding_attention"] * 2,
        "tie_embeddings": True,
        "embed_scale": True,
        "activation": "gelu_tanh",
    },
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_configs_are_read_as_transformers_reads_them(name):
    config = PUBLISHED[name]
    family = family_of(config)
    assert family.unaccounted(config) == {}
    hparams = family.hparams(config)
    assert {key: hparams[key] for key in PUBLISHED_HPARAMS[name]} == PUBLISHED_HPARAMS[name]
    assert family.hparams(family.export_config(hparams)) == hparams


DEFAULTS = {
    field.name: field.default
    for field in dataclasses.fields(registry.get_model("decoder").config)
    if field.name != "name"
}
BUILT = {
    "llama": {"mlp_bias": True},
    "mistral": {"sliding_window": 8},
    "qwen2": {"qkv_bias": True, "num_kv_heads": 2},
    "qwen3": {
        "qk_norm": True,
        "head_dim": 64,
        "layer_types": ["full_attention"] * 3 + ["sliding_attention"],
        "sliding_window": 8,
    },
    "gemma3_text": {
        "norm_unit_offset": True,
        "post_norms": True,
        "qk_norm": True,
        "embed_scale": True,
        "activation": "gelu_tanh",
        "query_scale": 24.0,
        "local_rope_theta": 10000.0,
        "rope_theta": 1e6,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    "deepseek_v3": {
        "head_dim": 24,
        "kv_lora_rank": 16,
        "q_lora_rank": 24,
        "rope_head_dim": 8,
        "value_head_dim": 16,
        "rope_interleaved": True,
        "num_experts": 4,
        "experts_per_token": 2,
        "expert_mlp_dim": 32,
        "router_softmax": "sigmoid",
        "router_groups": 2,
        "router_groups_kept": 1,
        "expert_weight_scale": 2.5,
        "shared_expert_mlp_dim": 64,
        "dense_layers": [0],
    },
}


def test_a_plain_decoder_exports_as_a_llama_or_a_mistral_without_a_window():
    exported = {}
    for family in DECODER_FAMILIES.values():
        with contextlib.suppress(zoo.ZooError):
            exported[family.name] = family.export_config(DEFAULTS)
    assert sorted(exported) == ["llama", "mistral"]
    assert exported["mistral"]["sliding_window"] is None


@pytest.mark.parametrize("name", sorted(BUILT))
def test_a_model_built_by_zoo_exports_to_the_one_layout_that_holds_it(name):
    """Each family's export config reads back as the model itself, or is refused naming the
    settings its layout cannot hold (a Llama's MLP biases are no Mistral's)."""
    hparams = {**DEFAULTS, **BUILT[name]}
    for family in DECODER_FAMILIES.values():
        if family.name == name:
            back = family.hparams(family.export_config(hparams))
            assert {key: hparams[key] for key in BUILT[name]} == {
                key: back[key] for key in BUILT[name]
            }
        else:
            with pytest.raises(zoo.ZooError, match=rf"The {family.name} layout .* cannot hold"):
                family.export_config(hparams)


def edited(name: str, **changes) -> dict:
    """The fixture's config with `changes` (a value of None: the key removed; `outer__inner`:
    a key within a nested dict)."""
    config = copy.deepcopy(config_of(name))
    for key, value in changes.items():
        *outer, last = key.split("__")
        target = config
        for part in outer:
            target = target[part]
        if value is None:
            target.pop(last, None)
        else:
            target[last] = value
    return config


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
REFUSED = {
    "yarn without its original context": (
        edited("llama-tiny", rope_parameters__rope_type="yarn"),
        r"rope_type 'yarn' but no original_max_position_embeddings",
    ),
    "a yarn key decoder does not read": (
        edited("llama3-rope", rope_scaling={**YARN, "low_freq_factor": 1.0}),
        r"rope_scaling has low_freq_factor=1\.0.*rope_type 'yarn'",
    ),
    "gpt_oss sliding layers without a window": (
        {**config_of("gpt-oss-tiny"), "sliding_window": None},
        r"gpt_oss config has sliding_window=None and sliding layers",
    ),
    "dynamic": (
        edited("qwen2-tiny", rope_scaling={"type": "dynamic", "factor": 2.0}),
        r"rope_type is 'dynamic'",
    ),
    "longrope": (
        edited("qwen3-tiny", rope_parameters__rope_type="longrope"),
        r"rope_type is 'longrope'",
    ),
    "gemma3 global dynamic": (
        edited("gemma3-tiny", rope_parameters__full_attention={**YARN, "rope_type": "dynamic"}),
        r"rope_parameters\.full_attention\.rope_type is 'dynamic'",
    ),
    "gemma3 local scaling": (
        edited("gemma3-v4", rope_local_base_freq=None, rope_scaling=None)
        | {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
        r"rope_type='linear' for sliding_attention",
    ),
    "partial rotary (top level)": (
        edited("mistral-window", partial_rotary_factor=0.5),
        r"partial_rotary_factor=0\.5",
    ),
    "partial rotary (in the dict)": (
        edited("llama-linear", rope_parameters__partial_rotary_factor=0.25),
        r"partial_rotary_factor=0\.25",
    ),
    "a RoPE key decoder does not read": (
        edited("llama-linear", rope_parameters__mscale=1.5),
        r"rope_parameters has mscale=1\.5.*rope_type 'linear'",
    ),
    "llama3 without its factors": (
        edited("llama3-rope", rope_scaling={"rope_type": "llama3", "factor": 8.0}),
        r"rope_type 'llama3' but no low_freq_factor",
    ),
    "exact gelu": (edited("qwen3-tiny", hidden_act="gelu"), r"hidden_act='gelu'"),
    "relu in gemma": (
        edited("gemma3-tiny", hidden_activation="relu"),
        r"hidden_activation='relu'.*gelu_pytorch_tanh",
    ),
    "quantized": (
        edited("qwen2-tiny", quantization_config={"quant_method": "gptq", "bits": 4}),
        r"quantization_config with quant_method='gptq'",
    ),
    "bidirectional": (
        edited("gemma3-tiny", use_bidirectional_attention=True),
        r"use_bidirectional_attention=true",
    ),
    "gemma3 attention softcap": (
        edited("gemma3-v4", attn_logit_softcapping=50.0),
        r"attn_logit_softcapping=50\.0.*does not\s+apply",
    ),
    "mistral layer_types": (
        edited("mistral-window", layer_types=["full_attention", "sliding_attention"]),
        r"mistral config has layer_types=.*does not read",
    ),
    "layer_types of another depth": (
        edited("gemma3-tiny", layer_types=["full_attention"] * 3),
        r"layer_types=.*num_hidden_layers=4",
    ),
    "an unknown layer type": (
        edited(
            "qwen3-tiny",
            use_sliding_window=True,
            sliding_window=4,
            layer_types=["chunked_attention", "full_attention"],
        ),
        r"'chunked_attention'",
    ),
    "kv heads that do not divide": (
        edited("llama-tiny", num_key_value_heads=3),
        r"num_attention_heads=4 and num_key_value_heads=3",
    ),
    "interleaved rope": (edited("llama-tiny", rope_interleaved=True), r"rope_interleaved=true"),
}


@pytest.mark.parametrize("config, message", REFUSED.values(), ids=REFUSED.keys())
def test_a_setting_decoder_does_not_implement_is_refused_by_name(config, message):
    with pytest.raises(zoo.ZooError, match=message):
        family_of(config).hparams(config)


def test_a_refused_setting_stops_the_load_before_anything_is_built(tmp_path):
    directory = tmp_path / "dynamic"
    shutil.copytree(FIXTURES / "qwen2-tiny", directory)
    (directory / "config.json").write_text(json.dumps(REFUSED["dynamic"][0]))
    with pytest.raises(zoo.ZooError, match=r"rope_scaling\.rope_type is 'dynamic'"):
        zoo.load(directory)


@pytest.mark.parametrize(("name", "theta"), [("mixtral-tiny", 1e6), ("qwen3-moe-tiny", 1e4)])
def test_a_config_without_rope_keys_has_its_family_s_rope_base(name, theta):
    """transformers' own default: 1e6 for Mixtral, 1e4 for the others."""
    config = edited(name, rope_parameters=None, rope_scaling=None, rope_theta=None)
    assert family_of(config).hparams(config)["rope_theta"] == theta


def test_qwens_sliding_layers_follow_max_window_layers_or_layer_types():
    config = edited("qwen2-tiny")
    family = family_of(config)
    assert family.hparams(config)["layer_types"] == ["full_attention", "sliding_attention"]
    given = {**config, "layer_types": ["sliding_attention", "full_attention"]}
    assert family.hparams(given)["layer_types"] == given["layer_types"]
    off = {**config, "use_sliding_window": False}
    assert (family.hparams(off)["sliding_window"], family.hparams(off)["layer_types"]) == (0, None)


@needs_reference
def test_references_regenerate(tmp_path):
    assert_references_regenerate("make_decoders", NAMES, tmp_path)


def test_model_keys_given_to_load_hold_the_params_in_bf16(tmp_path):
    directory = FIXTURES / "qwen3-tiny"
    full = zoo.load(directory, devices=jax.devices()[:1])
    low = zoo.load(directory, devices=jax.devices()[:1], model={"param_dtype": "bf16"})
    assert low.config.model.param_dtype == "bf16"
    full_params, low_params = (nnx.state(m.model, nnx.Param) for m in (full, low))
    for kept, rounded in zip(jax.tree.leaves(full_params), jax.tree.leaves(low_params)):
        assert rounded.dtype == jax.numpy.bfloat16  # the file's values, rounded once
        np.testing.assert_array_equal(rounded, kept.astype(jax.numpy.bfloat16))
    tokens = reference("qwen3-tiny")["tokens"]
    difference = np.abs(zoo.predict(low, tokens).astype(np.float32) - zoo.predict(full, tokens))
    assert 0 < difference.max() < 0.2  # bfloat16's rounding, no more
    with pytest.raises(zoo.ZooError, match="model.param_dtype='fp16'.*fp32, bf16"):
        zoo.load(directory, model={"param_dtype": "fp16"})
    run = zoo.fit("xor", "trainer.steps=1", f"workdir={tmp_path}")
    with pytest.raises(zoo.ZooError, match="is a run, whose model is loaded as it trained"):
        zoo.load(run.workdir, model={"param_dtype": "bf16"})

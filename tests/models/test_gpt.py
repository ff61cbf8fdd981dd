"""The byte-level language model on real text (the standard library's sources) and real meshes
(what every model passes: tests/conformance/): an untied head computes the single-device step
on every mesh, `nnx.scan`+`nnx.remat` compute what the plain layer loop does, variable-length
lines compile once per bucket with exact bits per byte, and sampling is reproducible,
consistent with the full forward pass and compiled a bounded number of times."""

from __future__ import annotations

import collections
import math

import compiled_as_users
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance.checks import (
    MESH,
    ONE_DEVICE,
    assert_abstract_build_equals_the_full_trace,
    planned_split,
    tiny_config,
    tiny_hparams,
)
from flax import nnx
from helpers import one_step, read_events
from model_checks import Models, outputs
from zoo.data.text import LENGTH, TOKENS
from zoo.engine import registry
from zoo.engine.loop.build import build_model
from zoo.engine.loop.trainer import Trainer
from zoo.engine.registry import get_data
from zoo.engine.sharding import abstract
from zoo.engine.sharding import mesh as sharding
from zoo.engine.sharding.mesh import DEFAULT_RULES
from zoo.models import sampling_loop, text_completion

import zoo

MESHES = [{"tensor": 2, "data": 4}, {"fsdp": 2, "tensor": 2, "data": 2}]


def config(workdir, mesh=None, *extra: str):
    sizes = {"data": 1, "fsdp": 1, "tensor": 1, **(mesh or {})}
    return tiny_config(
        "gpt",
        f"workdir={workdir}",
        "trainer.batch_size=16",
        "optimizer.warmup_steps=0",
        *(f"mesh.{axis}={size}" for axis, size in sizes.items()),
        *extra,
    )


UNTIED = "model.tie_embeddings=false"


@pytest.fixture(scope="module")
def single_device_step(tmp_path_factory):
    trainer = Trainer(config(tmp_path_factory.mktemp("ref"), None, UNTIED), jax.devices()[:1])
    return one_step(trainer)


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_every_mesh_computes_the_single_device_step_of_an_untied_head(
    single_device_step, mesh, tmp_path
):
    ref_loss, ref_grads = single_device_step
    trainer = Trainer(config(tmp_path, mesh, UNTIED))
    split = [r.path for r in trainer.plan.rows if r.group == "params" and "tensor" in str(r.spec)]
    assert "blocks.0.mlp_in.kernel" in split and "blocks.0.attention.query.kernel" in split
    loss, grads = one_step(trainer)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def _mesh():
    rules = sharding.AxisRules.from_mapping(DEFAULT_RULES)
    return sharding.activate(sharding.make_mesh(MESH), rules)


def _model(**overrides) -> nnx.Module:
    """The tiny gpt, three layers deep, on the 2x2x2 mesh."""
    tiny = {k: v for k, v in tiny_hparams("gpt").items() if k != "name"}
    return zoo.create_model("gpt", mesh=MESH, **{**tiny, "depth": 3, **overrides})


def _text_batch(size: int = 8) -> dict[str, np.ndarray]:
    splits = get_data("text").splits({"window": 32})
    return {name: value[:size] for name, value in splits.eval.items()}


def scanned_weights_are_the_loop_s() -> None:
    """Layer i of the loop is slice i of the scanned stack, bit for bit (`compiled_as_users`)."""
    loop = nnx.state(_model(dropout_rate=0.1).blocks, nnx.Param)
    scanned = nnx.state(_model(dropout_rate=0.1, scan_layers=True, remat=True).blocks, nnx.Param)
    for i in range(3):
        for a, b in zip(jax.tree.leaves(loop[i]), jax.tree.leaves(scanned), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[i])


def test_scan_and_remat_compute_what_the_layer_loop_does():
    compiled_as_users.run("test_gpt", "scanned_weights_are_the_loop_s")
    loop = _model(dropout_rate=0.1)
    scanned = _model(dropout_rate=0.1, scan_layers=True, remat=True)
    batch, loss_fn = _text_batch(), zoo.get_model("gpt").loss

    @nnx.jit
    def loss_and_grads(model, batch, rngs):
        def mean_loss(model, rngs):
            return jnp.mean(loss_fn(model, batch, rngs)[0])

        return nnx.value_and_grad(mean_loss)(model, rngs)

    with _mesh():  # train mode, dropout on: each layer draws the same mask either way
        loop_loss, loop_grads = loss_and_grads(loop, batch, nnx.Rngs(0))
        scan_loss, scan_grads = loss_and_grads(scanned, batch, nnx.Rngs(0))
        loop.eval()
        eval_loss, _ = loss_and_grads(loop, batch, nnx.Rngs(0))
    assert abs(float(eval_loss) - float(loop_loss)) > 1e-4  # dropout did act
    np.testing.assert_allclose(scan_loss, loop_loss, rtol=1e-5)
    for i in range(3):
        for a, b in zip(
            jax.tree.leaves(loop_grads["blocks"][i]),
            jax.tree.leaves(scan_grads["blocks"]),
            strict=True,
        ):
            np.testing.assert_allclose(np.asarray(b)[i], np.asarray(a), rtol=1e-4, atol=1e-6)
    for name in ("embedding", "positions"):
        np.testing.assert_allclose(
            scan_grads[name][...], loop_grads[name][...], rtol=1e-4, atol=1e-6
        )


@pytest.fixture(scope="module")
def models():
    return Models.tiny("gpt")


def logits(model, tokens):
    return model(tokens)


def test_a_position_sees_only_itself_and_earlier_ones(models):
    tokens = _text_batch()["tokens"][:, :-1].astype(np.int32)
    changed = tokens.copy()
    changed[:, 20:] = (changed[:, 20:] + 1) % 256
    before, after = (outputs(models.one, ONE_DEVICE, logits, t) for t in (tokens, changed))
    np.testing.assert_array_equal(before[:, :20], after[:, :20])
    assert not np.allclose(before[:, 20:], after[:, 20:])


def test_heads_mlp_and_vocabulary_split_over_tensor():
    planned = planned_split("gpt")
    assert {"embedding", "blocks.0.attention.key.kernel", "blocks.1.mlp_out.kernel"} <= planned


def test_generation_works_with_remat_and_scanned_layers(models):
    """The same weights in another layout write the same text (greedy, on the same mesh)."""
    layout = {**models.hparams, "scan_layers": True, "remat": True}
    other = zoo.create_model("gpt", mesh=MESH, **layout)
    models.split.eval()
    other.eval()
    with _mesh():
        want = text_completion.generate_bytes(models.split, "def f(x):", 12, temperature=0.0)
        assert text_completion.generate_bytes(other, "def f(x):", 12, temperature=0.0) == want


@pytest.mark.parametrize(
    "variant",
    [["model.depth=3"], ["model.tie_embeddings=false", "model.attention_bias=true"]],
    ids=["deeper", "untied-biased"],
)
def test_an_abstract_build_of_other_variants_equals_the_full_trace(variant):
    """Three cloned blocks; an untied head and attention biases."""
    assert_abstract_build_equals_the_full_trace("gpt", *variant)


def test_outside_an_abstract_build_the_initialisers_run():
    entry, params = registry.get_model("gpt"), tiny_hparams("gpt")

    def failing():
        build_model(entry, params, 0)
        raise RuntimeError("the build failed")

    with nnx.use_eager_sharding(False):
        with pytest.raises(RuntimeError, match="the build failed"):
            abstract.eval_shape(failing)
        model = build_model(entry, params, 0)
    kernels = [block.mlp_in.kernel[...] for block in model.blocks]
    assert all(np.abs(k).max() > 0 for k in kernels)
    assert not np.array_equal(kernels[0], kernels[1])  # each layer from its own key


BUCKETS = [32, 64, 96, 128]


@pytest.fixture(scope="module")
def lines_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("lines")
    cfg = zoo.compose(
        [
            "model=gpt",
            f"workdir={workdir}",
            "model.context_length=128",
            "model.dim=32",
            "model.depth=2",
            "model.num_heads=2",
            "data.mode=lines",
            f"data.buckets={BUCKETS}",
            "data.eval_bytes=3000",
            "trainer.batch_size=8",
            "trainer.steps=24",
            "trainer.eval_every=12",
            "trainer.log_every=12",
            "optimizer.warmup_steps=0",
        ]
    )
    trainer = Trainer(cfg)
    return trainer, trainer.fit()


def test_lines_compile_once_per_bucket(lines_run):
    trainer, _ = lines_run
    iterator = iter(trainer.train_data)
    train_lengths = {next(iterator)[TOKENS].shape[1] - 1 for _ in range(24)}
    eval_lengths = {batch[TOKENS].shape[1] - 1 for batch in trainer.eval_data}
    assert len(train_lengths) >= 2 and train_lengths <= set(BUCKETS), train_lengths
    assert trainer.train_step._cache_size() == len(train_lengths)
    assert trainer.eval_step._cache_size() == len(eval_lengths) <= len(BUCKETS)


def test_held_out_bits_per_byte_is_exact_over_real_bytes(lines_run):
    _, result = lines_run
    held_out = (
        get_data("text").splits({"mode": "lines", "buckets": BUCKETS, "eval_bytes": 3000}).eval
    )
    tokens = jnp.asarray(held_out[TOKENS].astype(np.int32))  # every line, padded to 128
    with result.activate(), sharding.unsplit_batch():
        log_probs = jax.nn.log_softmax(nnx.jit(lambda m, x: m(x))(result.model, tokens[:, :-1]))
    nll = -np.take_along_axis(np.asarray(log_probs), np.asarray(tokens[:, 1:, None]), -1)[..., 0]
    real = np.arange(nll.shape[1])[None, :] < held_out[LENGTH][:, None]
    per_byte = (nll * real).sum() / real.sum() / math.log(2)
    per_line = ((nll * real).sum(1) / real.sum(1)).mean() / math.log(2)
    assert abs(per_byte - per_line) > 0.01  # the weighting matters here
    np.testing.assert_allclose(result.eval_metrics["bits_per_byte"], per_byte, rtol=1e-4)


def test_each_eval_writes_a_sample(lines_run):
    _, result = lines_run
    samples = read_events(result.workdir).Tensors("sample/text_summary")
    assert [event.step for event in samples] == [12, 24]
    texts = [event.tensor_proto.string_val[0].decode() for event in samples]
    assert all(text.count("**continuation**") == 1 for text in texts)  # markdown, not a repr


def test_generation_is_reproducible_consistent_and_compiled_per_bucket():
    model = _model()
    model.eval()
    with _mesh():
        jax.clear_caches()  # what compiles here is counted, whatever ran before
        start = sampling_loop.COMPILATIONS.copy()
        same = [text_completion.generate(model, "def f(x):", 20, seed=3) for _ in range(2)]
        other = text_completion.generate(model, "def f(x):", 20, seed=4)
        raw = text_completion.generate_bytes(model, "def f(x):", 20, seed=3)
        for length, new in [(5, 7), (6, 3), (7, 12), (12, 19), (15, 2), (17, 9)]:
            text_completion.generate(
                model, "x" * length, new, temperature=0.5, top_k=5, seed=length
            )
        compiled = collections.Counter(key[:2] for key in sampling_loop.COMPILATIONS - start)
        greedy = text_completion.generate_bytes(model, "import os", 16, temperature=0.0)
        sequence = np.frombuffer(b"import os" + greedy, np.uint8).astype(np.int32)
        with sharding.unsplit_batch():
            logits = nnx.jit(lambda m, x: m(x))(model, jnp.asarray(sequence[None, :-1]))
    assert same[0] == same[1] != other
    assert len(raw) == 20 and same[0] == raw.decode("utf-8", errors="replace")
    assert "\ufffd" in same[0]  # an untrained model writes invalid UTF-8: replaced, not raised
    # One prefill per prompt bucket (16, 32) and sampler (plain, top-k), one decode step per
    # sampler, whatever the lengths.
    assert compiled == {("prefill", 1): 3, ("decode", 1): 2}
    # Greedy decoding with the KV cache picks what the full forward pass ranks first.
    np.testing.assert_array_equal(np.asarray(logits[0]).argmax(-1)[8:], sequence[9:])


@pytest.mark.parametrize(
    ("mesh", "override", "message"),
    [
        ({}, "data.path=/nonexistent/corpus", r"data.path=/nonexistent/corpus does not exist"),
        ({}, "model.num_heads=3", r"dim=32 must be a multiple of num_heads=3"),
        (
            {"tensor": 4},
            "model.num_heads=2",
            (
                r"'blocks.0.attention.\w+.kernel' \(shape .*\) has dimension \d of size 2 "
                r"\('heads'\), which mesh axes \['tensor'\] cannot split 4 ways"
            ),
        ),
        ({}, "data.window=64", r"sequences of 64 tokens, more than model.context_length=32"),
    ],
)
def test_bad_input_is_named(mesh, override, message, tmp_path):
    with pytest.raises(zoo.ZooError, match=message):
        Trainer(config(tmp_path, {"data": 8 // mesh.get("tensor", 1), **mesh}, override)).fit()


def test_a_directory_without_text_is_refused(tmp_path):
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2")
    with pytest.raises(zoo.ZooError, match=r"holds no text: no non-empty file without NUL"):
        get_data("text").splits({"path": str(tmp_path)})

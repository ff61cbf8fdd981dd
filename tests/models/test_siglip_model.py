"""siglip (transformers' `SiglipModel`, family `siglip`) on the tiny fixture that
`tests/fixtures/pretrained/make_siglip_model.py` writes: image and text embeddings, zero-shot
logits and probabilities and the sigmoid loss within 1e-5 of transformers' on one device and the
2x2x2 mesh; the export read back (and by transformers, with the reference extra); the configs it
does not build refused by name."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pretrained_checks as checks
import pytest
from conformance.checks import MESH, ONE_DEVICE, on_mesh
from flax import nnx
from helpers import read_events, scalar_steps
from pretrained_checks import FIXTURES, exported, loaded, reference
from zoo.data.siglip_tokenizer import SiglipTokenizer
from zoo.engine import registry
from zoo.engine.weights import pretrained as weights
from zoo.models import siglip

import zoo

NAME = "siglip-tiny"
ATOL = 1e-5


def outputs(model: siglip.Siglip, expected: dict, mesh=ONE_DEVICE) -> dict[str, np.ndarray]:
    """The model's embeddings, logits, probabilities and loss for the fixture's inputs, float32
    at the highest matmul precision, on `mesh`."""

    @nnx.jit
    def run(model, pixels, ids, mask):
        texts = model.embed_texts(ids, mask)
        logits = model.logits(pixels, ids, mask)
        pairs = {"image": pixels[: len(ids)], siglip.TOKENS: ids}
        loss = siglip.sigmoid_loss(_masked(model, mask), pairs, nnx.Rngs(0))[0].mean()
        return model(pixels), siglip._normalised(texts), logits, loss

    pixels = expected["images"]
    padded = np.concatenate([pixels, pixels[: -len(pixels) % 4]])  # the batch splits 4 ways
    inputs = (padded, expected["input_ids"], expected["attention_mask"])
    with on_mesh(mesh), jax.default_matmul_precision("highest"):
        images, texts, logits, loss = (np.asarray(x) for x in run(model, *inputs))
    images, logits = images[: len(pixels)], logits[: len(pixels)]
    return {
        "image_embeds": images,
        "text_embeds": texts,
        "logits_per_image": logits,
        "zero_shot_probs": 1 / (1 + np.exp(-logits.astype(np.float64))),
        "sigmoid_loss": loss,
    }


def _masked(model, mask):
    """`model` whose `logits` hides the padding of the fixture's texts (the loss calls it
    without a mask)."""

    class Masked:
        def logits(self, pixels, ids):
            return model.logits(pixels, ids, mask)

    return Masked()


@pytest.fixture(scope="module", params=[ONE_DEVICE, MESH], ids=["one-device", "mesh"])
def measured(request) -> dict[str, np.ndarray]:
    model, _ = loaded(FIXTURES / NAME, request.param)
    return outputs(model, reference(NAME), request.param)


@pytest.mark.parametrize(
    "key", ["image_embeds", "text_embeds", "logits_per_image", "zero_shot_probs", "sigmoid_loss"]
)
def test_outputs_are_transformers(measured, key):
    np.testing.assert_allclose(measured[key], reference(NAME)[key], rtol=0, atol=ATOL)


def test_the_options_come_from_config_json():
    hparams = weights.open_pretrained(FIXTURES / NAME).hparams()
    assert hparams["input_shape"] == [32, 32, 3] and hparams["patch_size"] == 8
    assert (hparams["vision_mlp_dim"], hparams["text_mlp_dim"]) == (40, 40)
    assert (hparams["vocab_size"], hparams["context_length"]) == (128, 16)
    assert not hparams["exact_gelu"] and hparams["norm_epsilon"] == 1e-6


def test_the_export_reads_back_with_the_same_outputs(tmp_path):
    model, hparams = loaded(FIXTURES / NAME)
    family = weights.open_pretrained(FIXTURES / NAME).family
    out = exported(model, hparams, family, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["SiglipModel"]
    assert config["vision_config"]["vision_use_head"] is True
    again, _ = loaded(out)
    expected = reference(NAME)
    np.testing.assert_allclose(
        outputs(again, expected)["zero_shot_probs"], expected["zero_shot_probs"], atol=ATOL
    )


def changed(tmp_path, **changes):
    """A copy of the fixture whose config.json has `changes` (a dict value for a tower's config
    updates its keys)."""
    directory = tmp_path / NAME
    shutil.copytree(FIXTURES / NAME, directory)
    config = json.loads((directory / "config.json").read_text())
    for key, value in changes.items():
        if isinstance(value, dict):
            config[key].update(value)
        else:
            config[key] = value
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"model_type": "siglip2"}, "model_type='siglip2'"),
        ({"text_config": {"hidden_act": "relu"}}, "text_config.hidden_act='relu'"),
        ({"vision_config": {"vision_use_head": False}}, "vision_use_head=false"),
        ({"text_config": {"projection_size": 16}}, "text_config.projection_size=16"),
        ({"text_config": {"layer_norm_eps": 1e-5}}, "text_config.layer_norm_eps=1e-05"),
        ({"vision_config": {"patch_size": [8, 4]}}, r"vision_config.patch_size=\[8, 4\]"),
    ],
)
def test_what_siglip_does_not_build_is_refused_by_name(tmp_path, changes, named):
    with pytest.raises(zoo.ZooError, match=named):
        zoo.load(changed(tmp_path, **changes), devices=jax.devices()[:1])


IMAGES = FIXTURES.parent / "image_processors" / "images"


@pytest.mark.parametrize("mesh", [ONE_DEVICE, MESH], ids=["one-device", "mesh"])
def test_zero_shot_probabilities_are_transformers(mesh):
    """Image files through the checkpoint's processor, labels through its tokenizer (the
    fixture's label texts are whole sentences: the template is `{}`)."""
    devices = jax.devices()[: int(np.prod(list(mesh.values())))]
    trained = zoo.load(FIXTURES / NAME, mesh=mesh, devices=devices)
    labels = json.loads((FIXTURES / NAME / "texts.json").read_text())["labels"]
    with jax.default_matmul_precision("highest"):
        probs = zoo.predict(trained, sorted(IMAGES.glob("*.png")), labels=labels, template="{}")
    np.testing.assert_allclose(probs, reference(NAME)["zero_shot_probs"], rtol=0, atol=ATOL)


def test_the_tokenizer_gives_transformers_ids():
    expected = reference(NAME)
    tokenizer = SiglipTokenizer(FIXTURES / NAME)
    ids, mask = tokenizer(json.loads((FIXTURES / NAME / "texts.json").read_text())["texts"])
    np.testing.assert_array_equal(ids, expected["text_ids"])
    np.testing.assert_array_equal(mask, expected["text_mask"])


def test_labels_need_a_siglip_model():
    trained = zoo.load(FIXTURES / "siglip-vision-tiny", devices=jax.devices()[:1])
    with pytest.raises(zoo.ZooError, match="zero-shot classification by a siglip model"):
        zoo.predict(trained, reference("siglip-vision-tiny")["images"], labels=["cat"])


@pytest.fixture(scope="module")
def one_device() -> zoo.TrainedModel:
    return zoo.load(FIXTURES / NAME, devices=jax.devices()[:1])


def test_predict_gives_the_texts_embeddings(one_device):
    """`texts=` alone: the labels' normalised embeddings, tokenised by the checkpoint's
    tokenizer, equal to transformers' `text_embeds`."""
    labels = json.loads((FIXTURES / NAME / "texts.json").read_text())["labels"]
    with jax.default_matmul_precision("highest"):
        embeds = zoo.predict(one_device, texts=labels)
    np.testing.assert_allclose(embeds, reference(NAME)["text_embeds"], rtol=0, atol=ATOL)


@pytest.mark.parametrize(
    "call, named",
    [
        (lambda m: zoo.predict(m, texts=["a"], labels=["b"]), "takes the texts alone"),
        (lambda m: zoo.predict(m, reference(NAME)["images"], texts=["a"]), "got inputs too"),
        (lambda m: zoo.predict(m, texts=[]), "non-empty list of strings"),
        (lambda m: zoo.predict(m, texts="a cat"), "non-empty list of strings"),
        (lambda m: zoo.predict(m), "predict got no inputs"),
    ],
)
def test_bad_texts_are_refused_by_name(one_device, call, named):
    with pytest.raises(zoo.ZooError, match=named):
        call(one_device)


def test_texts_need_a_siglip_model():
    trained = zoo.load(FIXTURES / "siglip-vision-tiny", devices=jax.devices()[:1])
    with pytest.raises(zoo.ZooError, match="predict\\(texts=...\\) gives a siglip model's"):
        zoo.predict(trained, texts=["a cat"])


@checks.needs_reference
def test_the_export_loads_in_transformers_with_the_same_outputs(tmp_path):
    import torch
    from transformers import SiglipModel

    model, hparams = loaded(FIXTURES / NAME)
    family = weights.open_pretrained(FIXTURES / NAME).family
    module = SiglipModel.from_pretrained(exported(model, hparams, family, tmp_path / "out"))
    expected = reference(NAME)
    pixels = torch.from_numpy(expected["images"].transpose(0, 3, 1, 2).copy())
    texts = {k: torch.from_numpy(expected[k]).long() for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        out = module.eval()(**texts, pixel_values=pixels)
    probs = torch.sigmoid(out.logits_per_image).numpy()
    np.testing.assert_allclose(probs, expected["zero_shot_probs"], rtol=0, atol=ATOL)


@checks.needs_reference
def test_the_references_regenerate_live(tmp_path):
    checks.assert_references_regenerate("make_siglip_model", [NAME], tmp_path)


def test_the_vision_tower_loads_as_vit_only_when_asked():
    """A SiglipModel directory is model siglip's; `model=vit` names its vision tower's family."""
    assert weights.open_pretrained(FIXTURES / NAME).family.name == "siglip"
    assert weights.open_pretrained(FIXTURES / NAME, "vit").family.name == "hf-siglip-model-vision"


def test_vit_from_a_siglip_model_has_its_vision_towers_features():
    """vit (its head made the identity) gives the mean of siglip's vision tokens after the final
    LayerNorm: `SiglipForImageClassification`'s features, before the attention-pooling head."""
    pretrained = weights.open_pretrained(FIXTURES / NAME, "vit")
    hparams = {**pretrained.hparams(), "num_classes": 32}
    with on_mesh(ONE_DEVICE):
        vit = registry.get_model("vit").build(hparams, nnx.Rngs(0))
        skipped = weights.fill(vit, pretrained, hparams=hparams, skip=("head",))
    assert skipped == ["head.bias", "head.kernel"]
    vit.head.kernel[...] = np.eye(32, dtype=np.float32)
    vit.head.bias[...] = np.zeros(32, np.float32)
    vit.eval()
    model, _ = loaded(FIXTURES / NAME)
    pixels = reference(NAME)["images"]

    @nnx.jit
    def tower(model, pixels):
        """`embed_images` up to the attention-pooling head, the tokens' mean instead."""
        spec = siglip.logical_spec
        patches = model.embed(pixels, out_sharding=spec("batch", None, None, None))
        tokens = patches.reshape(pixels.shape[0], -1, patches.shape[-1])
        table = jax.sharding.reshard(model.positions[...], spec(None, None))
        return model.vision(tokens + table).mean(axis=1)

    with on_mesh(ONE_DEVICE), jax.default_matmul_precision("highest"):
        expected = np.asarray(tower(model, pixels))
        features = np.asarray(nnx.jit(lambda m, x: m(x))(vit, pixels * 0.5 + 0.5))
    np.testing.assert_allclose(features, expected, rtol=0, atol=ATOL)


def test_the_vision_tower_fine_tunes_as_a_vit_classifier(tmp_path):
    """`model=vit` on the SiglipModel directory: a fresh head for 2 classes, a few steps on
    bright and dark images lower the loss; the export is `SiglipForImageClassification`'s,
    read back as vit with the same outputs."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 64).astype(np.int32)
    images = (
        rng.uniform(0, 0.5, (64, 32, 32, 3)).astype(np.float32) + labels[:, None, None, None] / 2
    )
    split = {"image": images, "label": labels}
    result = zoo.finetune(
        FIXTURES / NAME,
        "model=vit",
        "trainer.steps=12",
        "trainer.log_every=4",
        "trainer.batch_size=16",
        "optimizer.learning_rate=1e-2",
        f"workdir={tmp_path / 'run'}",
        data=zoo.Splits(train=split, eval=split),
        num_classes=2,
        replace_head=True,
    )
    losses = scalar_steps(read_events(result.workdir), "train/loss")
    assert result.model.head.kernel.shape == (32, 2)
    assert sorted(losses) == [4, 8, 12] and losses[12] < losses[4], losses
    out = zoo.export(result.workdir, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["SiglipForImageClassification"]
    again = zoo.load(out, devices=jax.devices()[:1])
    assert again.config.model.name == "vit"
    logits = zoo.predict(again, images[:4])  # on one device, the run's on its mesh
    np.testing.assert_allclose(logits, zoo.predict(result, images[:4]), rtol=0, atol=ATOL)

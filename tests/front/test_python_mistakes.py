"""The mistakes a user of the Python API makes, each answered by one paragraph that names the bad
value and what would be valid, before anything is written; and what a Python run prints and
writes, as the CLI does."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import zoo

TINY_MLP = ("data=digits", "model.hidden_sizes=[16]", "trainer.batch_size=64")
TUNE = ("trainer.steps=10", "trainer.batch_size=64")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A small mlp trained on digits for a few steps, through `zoo.fit`."""
    workdir = tmp_path_factory.mktemp("base")
    return zoo.fit("mlp", *TINY_MLP, "trainer.steps=10", f"workdir={workdir}")


@pytest.fixture(scope="module")
def digits():
    return zoo.load_data("digits")


def user_splits(digits, train=None, evaluate=None) -> zoo.Splits:
    train = train or {"image": digits.train["image"], "label": digits.train["label"]}
    evaluate = evaluate or {"image": digits.eval["image"], "label": digits.eval["label"]}
    return zoo.Splits(train, evaluate, transform=digits.transform)


def refused(tmp_path, match: str, start, **kwargs) -> str:
    """`zoo.finetune` into a fresh workdir is refused with `match`, and writes nothing."""
    workdir = tmp_path / "tuned"
    with pytest.raises(zoo.ZooError, match=match) as error:
        zoo.finetune(start, *TUNE, f"workdir={workdir}", **kwargs)
    assert not workdir.exists()
    return str(error.value)


def test_a_freeze_pattern_that_matches_nothing_is_refused(base, tmp_path):
    message = refused(tmp_path, "freeze=backbon matches none of the model's params", base,
                      freeze="backbon")  # fmt: skip
    assert "modules: head, hidden" in message and "'backbone'" in message
    assert "finetune." not in message  # Python's names for a Python caller


def test_a_freeze_pattern_that_matches_everything_is_refused(base, tmp_path):
    message = refused(tmp_path, r"freeze=\.\* freezes every param", base, freeze=".*")
    assert "nothing would learn" in message and "'backbone'" in message


@pytest.mark.parametrize("bad", [11, -1])
def test_labels_outside_the_classes_are_refused_naming_them(base, digits, tmp_path, bad):
    labels = digits.train["label"].copy()
    labels[[3, 70]] = bad
    train = {"image": digits.train["image"], "label": labels}
    data = user_splits(digits, train=train)
    message = refused(tmp_path, rf"'label' column holds {bad}, outside", base, data=data)
    assert "num_classes=10" in message and "0..9" in message


def test_float_labels_are_refused(base, digits, tmp_path):
    train = {"image": digits.train["image"], "label": digits.train["label"].astype(np.float32)}
    refused(tmp_path, "holds float32 values.*integer class labels 0..9", base,
            data=user_splits(digits, train=train))  # fmt: skip


@pytest.mark.parametrize("columns", [("x", "y"), ("image", "labels")])
def test_wrong_column_names_name_what_each_model_reads(base, digits, tmp_path, columns):
    image, label = columns
    train = {image: digits.train["image"], label: digits.train["label"]}
    evaluate = {image: digits.eval["image"], label: digits.eval["label"]}
    message = refused(tmp_path, "The train data has no column", base,
                      data=zoo.Splits(train, evaluate))  # fmt: skip
    assert f"it has '{image}', '{label}'" in message
    assert "model 'mlp' reads 'image', 'label'" in message
    for family in ("cnn, mlp, resnet, vit: image, label", "gpt: tokens, length", "vae: image"):
        assert family in message  # (models registered elsewhere in the process join the list)
    assert "xor: inputs, label" in message


def test_evaluate_checks_columns_and_labels_too(base, digits):
    with pytest.raises(zoo.ZooError, match="The eval data has no column 'label': it has 'image'"):
        zoo.evaluate(base, {"image": normalised(digits, 8)})
    labels = np.full(8, 10, np.int32)
    with pytest.raises(zoo.ZooError, match="'label' column holds 10, outside"):
        zoo.evaluate(base, {"image": normalised(digits, 8), "label": labels})


def test_images_without_a_channel_axis_are_refused_naming_input_shape(base, digits, tmp_path):
    flat = {
        split: {"image": columns["image"][..., 0], "label": columns["label"]}
        for split, columns in (("train", digits.train), ("eval", digits.eval))
    }
    data = zoo.Splits(flat["train"], flat["eval"])
    message = refused(tmp_path, r"images of shape \(8, 8\); model 'mlp' takes", base, data=data)
    assert "input_shape [8, 8, 1]" in message and "images[..., None]" in message


def test_a_new_head_is_asked_for_by_its_python_name(base, tmp_path):
    with pytest.raises(zoo.ZooError, match="it does not fit the model") as error:
        zoo.finetune(base, *TUNE, f"workdir={tmp_path}", num_classes=5)
    assert "e.g. replace_head=True" in str(error.value)
    assert "finetune.reinit" not in str(error.value)


def test_an_explicit_warmup_longer_than_the_run_stays_an_error(tmp_path):
    with pytest.raises(zoo.ZooError, match="warmup_steps=50 must lie between 0 and trainer.s"):
        zoo.fit("xor", "trainer.steps=10", "optimizer.warmup_steps=50", f"workdir={tmp_path}/a")
    assert not (tmp_path / "a").exists()


def normalised(digits, count: int) -> np.ndarray:
    return digits.transform({"image": digits.eval["image"][:count]})["image"]


@pytest.mark.parametrize(
    ("shape", "match"),
    [
        ((4, 8, 8), r"inputs of shape \(4, 8, 8\).*input_shape is \[8, 8, 1\].*\[\.\.\., None\]"),
        ((4, 6, 6, 1), r"inputs of shape \(4, 6, 6, 1\).*takes a batch \(N, 8, 8, 1\)"),
        ((8, 8, 1), r"one image of shape \(8, 8, 1\).*inputs\[None\]"),
    ],
)
def test_predict_refuses_inputs_of_another_shape(base, shape, match):
    with pytest.raises(zoo.ZooError, match=match):
        zoo.predict(base, np.zeros(shape, np.float32))


def test_predict_refuses_raw_pixels_naming_the_transform(base, digits):
    with pytest.raises(zoo.ZooError, match=r'uint8 images.*load_data\("digits"\)\.transform'):
        zoo.predict(base, digits.eval["image"][:4])
    assert zoo.predict(base, normalised(digits, 4)).shape == (4, 10)


def test_a_loaded_model_outside_its_mesh_names_activate(base, digits):
    trained = zoo.load(base.workdir)
    with pytest.raises(zoo.ZooError, match=r"inside `with trained\.activate\(\)"):
        trained.model(normalised(digits, 8))
    with trained.activate():
        assert trained.model(normalised(digits, 8)).shape == (8, 10)


def test_best_without_best_metric_says_which_it_chose(base, caplog):
    with caplog.at_level(logging.WARNING, logger="zoo"):
        loaded = zoo.load(base.workdir, step="best")
    assert loaded.step == 10
    assert "set no trainer.best_metric" in caplog.text and "using step 10" in caplog.text


def test_a_python_run_prints_and_writes_what_the_cli_does(tmp_path):
    """In a fresh interpreter, as a user's script: progress, eval and final lines on the
    console, and the same lines, the config and the overrides in the workdir."""
    script = (
        "import zoo\nzoo.fit('xor', 'trainer.steps=100', 'trainer.log_every=50', 'workdir=run')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env={**os.environ, "JAX_NUM_CPU_DEVICES": "1"},
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith("Training xor on xor for 100 steps (batch 128)")
    assert lines[1] == f"devices: 1 x cpu (jax {jax.__version__})"
    for expected in ("step 50/100 accuracy", "step 100/100 accuracy", "eval @ step 100:"):
        assert any(line.startswith(expected) for line in lines), expected
    assert lines[-1].startswith("Final eval @ step 100: accuracy")
    assert not any(line.startswith("INFO:") for line in lines)
    log = (tmp_path / "run" / "train.log").read_text()
    assert "step 100/100 accuracy" in log and "Final eval @ step 100" in log
    assert "model.name" not in log and (tmp_path / "run" / ".hydra" / "config.yaml").is_file()
    assert "trainer.steps=100" in (tmp_path / "run" / ".hydra" / "overrides.yaml").read_text()

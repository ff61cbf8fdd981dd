"""Users' own images: folders, ArrayRecord shards and Parquet files of real encoded images,
decoded and augmented deterministically, trained from the CLI and from Python, bad data
refused or skipped as documented."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from array_record.python.array_record_module import ArrayRecordReader
from helpers import ROOT, run_cli
from image_files import CLASSES, picture, write_folder
from omegaconf import OmegaConf
from PIL import Image
from zoo.data.image_options import IMAGENET_MEAN
from zoo.engine.errors import ZooError
from zoo.engine.registry import get_data

import zoo

SMALL = ("model.hidden_sizes=[16]", "trainer.batch_size=16", "optimizer.warmup_steps=0")
QUICK = ("trainer.steps=6", "trainer.log_every=3", "trainer.eval_every=6")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("images")
    write_folder(root)
    return root


@pytest.fixture(scope="module")
def shards(folder, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards")
    converted = subprocess.run(
        [sys.executable, "-m", "zoo.data", "convert", "images", str(folder), str(out)]
        + ["--records-per-shard", "10"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert converted.returncode == 0, converted.stderr
    assert converted.stdout.strip() == f"{12 * len(CLASSES)} images written to {out}"
    return out


@pytest.fixture(scope="module")
def parquet_file(folder, tmp_path_factory) -> Path:
    files = sorted(folder.rglob("*.*"))
    table = pa.table(
        {"jpeg": [f.read_bytes() for f in files], "kind": [f.parent.name for f in files]}
    )
    path = tmp_path_factory.mktemp("parquet") / "images.parquet"
    pq.write_table(table, path)
    return path


def images(path, **params):
    return get_data("images").splits({"path": str(path), "image_size": 16, **params})


def test_every_format_and_mode_becomes_the_models_channels(folder):
    for channels in (3, 1):
        splits = images(folder, channels=channels)
        rows = np.arange(len(splits.train))
        batch = splits.train.examples(rows, None, 0)
        assert batch["image"].shape == (len(rows), 16, 16, channels)
        assert batch["image"].dtype == np.uint8
    assert get_data("images").facts({"path": str(folder), "image_size": 16, "channels": 1}) == {
        "input_shape": (16, 16, 1),
        "num_classes": 3,
    }


def test_eval_view_is_the_resized_centre_crop(tmp_path):
    pixels = np.zeros((20, 40, 3), np.uint8)
    pixels[:, 10:30] = 255  # the centre square is white, the sides black
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for name in ("a", "b"):
        for i in range(2):
            Image.fromarray(pixels).save(tmp_path / name / f"{i}.png")
    splits = images(tmp_path, eval_fraction=0.5)
    view = splits.eval.examples(np.array([0]), None, 0)["image"]
    assert (view[:, :, 1:-1] == 255).all() and (view > 200).all()  # edges: the filter's reach


def test_training_views_depend_on_seed_example_and_epoch_only(folder):
    train = images(folder).train
    rows, epochs = np.array([3, 7, 3]), np.array([0, 0, 0])
    first = train.examples(rows, epochs, seed=1)["image"]
    np.testing.assert_array_equal(first, train.examples(rows, epochs, seed=1)["image"])
    np.testing.assert_array_equal(first[0], first[2])  # same example, epoch and seed
    assert (first != train.examples(rows, epochs + 1, seed=1)["image"]).any()
    assert (first != train.examples(rows, epochs, seed=2)["image"]).any()
    strong = images(folder, augment="strong").train.examples(rows, epochs, seed=1)["image"]
    assert (strong != first).any()


def test_held_out_split_is_fixed_and_keeps_every_class(folder):
    a, b = images(folder), images(folder)
    assert len(a.train) + len(a.eval) == 12 * len(CLASSES)
    np.testing.assert_array_equal(a.eval.labels, b.eval.labels)
    assert set(a.eval.labels.tolist()) == {0, 1, 2}
    assert [a.eval.payloads.name(i) for i in range(len(a.eval))] == [
        b.eval.payloads.name(i) for i in range(len(b.eval))
    ]


def test_train_and_val_folders_are_the_splits(tmp_path):
    write_folder(tmp_path / "train", per_class=4)
    write_folder(tmp_path / "val", per_class=2)
    splits = images(tmp_path)
    assert (len(splits.train), len(splits.eval)) == (12, 6)
    assert all("/val/" in splits.eval.payloads.name(i) for i in range(6))


def test_normalisation_by_the_data_sets_statistics_or_imagenets(folder):
    own = images(folder).transform
    batch = images(folder).train.examples(np.arange(36), None, 0)
    normalised = own(batch)["image"]
    assert abs(normalised.mean()) < 0.05 and abs(normalised.std() - 1) < 0.05
    assert images(folder, normalize="imagenet").transform.mean == IMAGENET_MEAN


def test_converter_writes_each_file_as_it_is_with_its_class(folder, shards):
    files = sorted(shards.glob("*.array_record"))
    assert [f.name for f in files] == [f"images-0000{i}-of-00004.array_record" for i in range(4)]
    reader = ArrayRecordReader(str(files[0]))
    record = msgpack.unpackb(reader.read())
    reader.close()
    assert record["image"] == (folder / record["name"]).read_bytes()
    assert record["label"] == Path(record["name"]).parent.name


@pytest.mark.parametrize("fmt", ["arrayrecord", "parquet"])  # images: the fine-tune's base
def test_each_format_trains_from_python(fmt, shards, parquet_file, tmp_path):
    where = {
        "arrayrecord": [f"data.path={shards}"],
        "parquet": [
            f"data.path={parquet_file}",
            "data.image_column=jpeg",
            "data.label_column=kind",
        ],
    }[fmt]
    result = zoo.fit(
        "mlp", f"data={fmt}", *where, "data.image_size=16", *SMALL, *QUICK,
        f"workdir={tmp_path}",
    )  # fmt: skip
    assert result.model.head.kernel.shape == (16, 3)
    assert 0 <= result.eval_metrics["accuracy"] <= 1
    assert (tmp_path / "checkpoints" / "6").is_dir()


@pytest.fixture(scope="module")
def every_format(folder, shards, tmp_path_factory) -> Path:
    """One folder that each format reads its own way: class subfolders of image files,
    `*.array_record` shards and a `*.parquet` file side by side."""
    root = tmp_path_factory.mktemp("every_format")
    write_folder(root)
    for shard in shards.glob("*.array_record"):
        (root / shard.name).write_bytes(shard.read_bytes())
    files = sorted(folder.rglob("*.*"))
    table = pa.table(
        {"image": [f.read_bytes() for f in files], "label": [f.parent.name for f in files]}
    )
    pq.write_table(table, root / "images.parquet")
    return root


def test_every_format_trains_from_the_command_line(every_format, tmp_path):
    result = run_cli(
        "-m", "model=mlp", "data=images,arrayrecord,parquet", f"data.path={every_format}",
        "data.image_size=16", "data.workers=1", *SMALL, *QUICK, f"workdir={tmp_path}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for job, fmt in enumerate(["images", "arrayrecord", "parquet"]):
        log = (tmp_path / str(job) / "train.log").read_text()
        assert f"Training mlp on {fmt} for 6 steps" in log
        assert "eval @ step 6: accuracy" in log
        assert (tmp_path / str(job) / "checkpoints" / "6").is_dir()


# ---- Bad data ----


@pytest.fixture(scope="module")
def damaged(tmp_path_factory) -> Path:
    """A folder with a corrupt JPEG (random bytes), a truncated one and a text file named .png."""
    root = tmp_path_factory.mktemp("damaged")
    write_folder(root, per_class=6)
    (root / "ant" / "corrupt.jpg").write_bytes(np.random.default_rng(0).bytes(500))
    large = np.random.default_rng(1).integers(0, 255, (96, 96, 3)).astype(np.uint8)
    Image.fromarray(large).save(root / "bee" / "whole.jpg")
    whole = (root / "bee" / "whole.jpg").read_bytes()
    (root / "bee" / "whole.jpg").unlink()
    (root / "bee" / "truncated.jpg").write_bytes(whole[: len(whole) * 3 // 4])
    (root / "cat" / "notes.png").write_text("not an image")
    return root


def test_files_that_are_not_images_are_skipped_by_name_and_counted(damaged, caplog):
    with caplog.at_level(logging.WARNING, logger="zoo"):
        splits = images(damaged, eval_fraction=0.2)
    logged = caplog.text
    assert "corrupt.jpg" in logged and "notes.png" in logged
    assert "Skipped 2 of the" in logged
    names = [splits.train.payloads.name(i) for i in range(len(splits.train))]
    names += [splits.eval.payloads.name(i) for i in range(len(splits.eval))]
    assert not any(n.endswith(("corrupt.jpg", "notes.png")) for n in names)
    assert len(names) == 18 + 1  # the truncated file's header reads: found when decoded


def test_a_truncated_file_is_replaced_by_the_next_example_with_a_warning(damaged, caplog):
    splits = images(damaged, eval_fraction=0.2)
    for split in (splits.train, splits.eval):
        names = [split.payloads.name(i) for i in range(len(split))]
        if any(n.endswith("truncated.jpg") for n in names):
            row = next(i for i, n in enumerate(names) if n.endswith("truncated.jpg"))
            with caplog.at_level(logging.WARNING, logger="zoo"):
                batch = split.examples(np.array([row]), None, 0)
            following = split.examples(np.array([(row + 1) % len(split)]), None, 0)
            np.testing.assert_array_equal(batch["image"], following["image"])
            assert "truncated.jpg" in caplog.text and "1 skipped so far" in caplog.text


def test_on_error_raise_stops_before_training_naming_every_bad_file(damaged):
    with pytest.raises(ZooError) as error:
        images(damaged, on_error="raise", eval_fraction=0.2)
    message = str(error.value)
    assert message.startswith("3 of the")
    assert all(name in message for name in ("corrupt.jpg", "truncated.jpg", "notes.png"))


def test_folders_without_images_are_refused(tmp_path):
    write_folder(tmp_path / "data", per_class=2)
    (tmp_path / "data" / "empty").mkdir()
    with pytest.raises(ZooError, match=r"class folder .*empty holds no image files"):
        images(tmp_path / "data")
    (tmp_path / "flat").mkdir()
    Image.fromarray(picture(0, 0)).save(tmp_path / "flat" / "0.png")
    with pytest.raises(ZooError, match="has no subfolders"):
        images(tmp_path / "flat")
    with pytest.raises(ZooError, match="is not a directory"):
        images(tmp_path / "missing")


def test_a_bad_folder_fails_the_command_before_anything_is_written(tmp_path):
    result = run_cli(
        "model=cnn", "data=images", f"data.path={tmp_path / 'missing'}",
        f"workdir={tmp_path / 'run'}",
    )  # fmt: skip
    assert result.returncode == 2
    assert "is not a directory" in result.stderr
    assert not (tmp_path / "run").exists()


def test_tables_without_the_named_columns_or_with_labels_outside_the_classes(tmp_path):
    Image.fromarray(picture(0, 0)).save(tmp_path / "x.png")
    png = (tmp_path / "x.png").read_bytes()
    pq.write_table(pa.table({"image": [png] * 4, "label": [0, 1, 2, 3]}), tmp_path / "t.parquet")
    with pytest.raises(ZooError, match=r"no column\(s\) pixels.*columns are image, label"):
        get_data("parquet").splits({"path": str(tmp_path / "t.parquet"), "image_column": "pixels"})
    with pytest.raises(ZooError, match=r"labels outside the 3 classes 0..2: \[3\]"):
        get_data("parquet").splits({"path": str(tmp_path / "t.parquet"), "num_classes": 3})
    pq.write_table(pa.table({"image": [png] * 2, "label": [0, -1]}), tmp_path / "n.parquet")
    with pytest.raises(ZooError, match=r"labels outside .*\[-1\]"):
        get_data("parquet").splits({"path": str(tmp_path / "n.parquet")})


def test_arrayrecord_labels_outside_the_classes_are_refused(shards):
    with pytest.raises(ZooError, match="holds labels outside"):
        get_data("arrayrecord").splits({"path": str(shards), "num_classes": 2})


def test_parquet_arrays_of_pixels_are_images_too(tmp_path):
    pixels = [picture(i % 3, i)[:, :, 0].tolist() for i in range(9)]
    pq.write_table(
        pa.table({"image": pixels, "label": [i % 3 for i in range(9)]}), tmp_path / "a.parquet"
    )
    splits = get_data("parquet").splits({"path": str(tmp_path / "a.parquet"), "image_size": 8})
    batch = splits.train.examples(np.arange(len(splits.train)), None, 0)
    assert batch["image"].shape == (len(splits.train), 8, 8, 3)


def test_an_image_folder_trains_from_python_and_fine_tunes_on_another(folder, tmp_path):
    base = zoo.fit(
        "mlp", "data=images", f"data.path={folder}", "data.image_size=16", *SMALL, *QUICK,
        f"workdir={tmp_path / 'base'}",
    )  # fmt: skip
    assert base.model.head.kernel.shape == (16, 3)
    assert 0 <= base.eval_metrics["accuracy"] <= 1
    assert (tmp_path / "base" / "checkpoints" / "6").is_dir()
    two_classes = tmp_path / "two"
    write_folder(two_classes, per_class=6, classes=("yes", "no"))
    tuned = zoo.finetune(
        base, "data=images", f"data.path={two_classes}", "data.image_size=16",
        "data.normalize=imagenet", "trainer.steps=3", "trainer.log_every=3",
        "trainer.eval_every=3", "optimizer.warmup_steps=0", f"workdir={tmp_path / 'tuned'}",
        replace_head=True, freeze="backbone",
    )  # fmt: skip
    assert tuned.model.head.kernel.shape == (16, 2)
    assert tuned.config.finetune.init_from == str(tmp_path / "base")
    np.testing.assert_array_equal(
        tuned.model.hidden[0].kernel[...], base.model.hidden[0].kernel[...]
    )


# ---- A pretrained model on an image folder ----

PRETRAINED = ROOT / "tests" / "fixtures" / "pretrained" / "resnet18-timm"


def test_a_pretrained_model_sees_the_pixels_its_weights_expect(tmp_path):
    """The fixture's reference images written as PNG files: the folder's pipeline, as a
    fine-tune from the directory composes it, feeds the model pixels for which it gives the
    reference library's logits (normalised once, by the model with ImageNet's statistics)."""
    reference = np.load(PRETRAINED / "reference.npz")
    for split in ("train", "val"):
        for i, pixels in enumerate(reference["images"]):
            (tmp_path / split / f"class{i}").mkdir(parents=True)
            Image.fromarray(np.round(pixels * 255).astype(np.uint8)).save(
                tmp_path / split / f"class{i}" / "0.png"
            )
    start = [f"finetune.init_from={PRETRAINED}", "data=images", f"data.path={tmp_path}"]
    cfg = zoo.compose([*start, "data.image_size=40"])
    assert cfg.data.normalize == "none"
    data = {
        k: v for k, v in OmegaConf.to_container(cfg.data, enum_to_str=True).items() if k != "name"
    }
    splits = zoo.load_data("images", **data)
    batch = splits.transform(splits.eval.examples(np.arange(4), None, 0))
    logits = zoo.predict(zoo.load(PRETRAINED), batch["image"])
    np.testing.assert_allclose(logits, reference["logits"], atol=0.02)  # pixels rounded to 8 bits
    for twice in ("data.normalize=imagenet", "data.normalize=dataset"):
        with pytest.raises(ZooError, match=f"{twice} would normalise the pixels twice"):
            zoo.compose([*start, twice])

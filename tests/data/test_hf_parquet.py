"""Parquet files in the layout of Hugging Face `datasets`, written by `datasets` itself
(`tests/fixtures/hf_images/make_hf_images.py`): an `Image()` column of structs of `bytes` and
`path`, embedded as the Hub exports them or as paths only, and a `ClassLabel` column whose
names are in the schema's metadata."""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import ROOT, read_events, run_cli
from PIL import Image
from zoo.engine.errors import ZooError
from zoo.engine.registry import get_data

FIXTURE = ROOT / "tests" / "fixtures" / "hf_images"
EMBEDDED, BY_PATH = FIXTURE / "images.parquet", FIXTURE / "by_path" / "images.parquet"
NAMES = ["cat", "ant", "bee"]  # the ClassLabel's, in label order (not sorted)
PICTURES = {
    label: [
        np.asarray(Image.open(FIXTURE / "by_path" / "pictures" / f"{name}_{i}.png"))
        for i in range(4)
    ]
    for label, name in enumerate(NAMES)
}


def parquet(path, **params):
    return get_data("parquet").splits({"path": str(path), "image_size": 8, **params})


@pytest.mark.parametrize("path", [EMBEDDED, BY_PATH], ids=["embedded", "by_path"])
def test_each_picture_is_read_with_its_label_and_the_class_labels_names(path):
    splits = parquet(path, eval_fraction=0.25)
    assert splits.class_names == NAMES
    assert get_data("parquet").facts({"path": str(path)})["num_classes"] == 3
    seen = []
    for split in (splits.train, splits.eval):
        batch = split.examples(np.arange(len(split)), None, 0)
        for image, label in zip(batch["image"], batch["label"], strict=True):
            matches = [i for i, picture in enumerate(PICTURES[label]) if (image == picture).all()]
            assert len(matches) == 1
            seen.append((int(label), matches[0]))
    assert sorted(seen) == [(label, i) for label in range(3) for i in range(4)]


def test_a_path_without_its_file_is_refused_by_row_and_path(tmp_path):
    shutil.copy(BY_PATH, tmp_path / "images.parquet")
    with pytest.raises(ZooError) as error:
        parquet(tmp_path / "images.parquet")
    message = str(error.value)
    assert "12 row(s) of data.image_column='image' hold no image bytes" in message
    assert "rows 0 (pictures/cat_0.png), 1 (pictures/ant_0.png)" in message
    assert f"read from the Parquet file's folder, {tmp_path}" in message


def test_a_row_without_an_image_is_skipped_by_name(tmp_path, caplog):
    """A struct whose bytes and path are both null, or a null struct: no image, which
    `data.on_error=skip` leaves out with a warning, as any image that cannot be decoded."""
    table = pq.read_table(EMBEDDED)
    images = table["image"].to_pylist()
    images[0], images[1] = {"bytes": None, "path": None}, None
    column = pa.array(images, type=table.schema.field("image").type)
    pq.write_table(table.set_column(0, "image", column), tmp_path / "gaps.parquet")
    with caplog.at_level(logging.WARNING, logger="zoo"):
        splits = parquet(tmp_path / "gaps.parquet")
    assert len(splits.train) + len(splits.eval) == 10
    assert "Skipping row 0 of" in caplog.text and "Skipping row 1 of" in caplog.text


def test_an_exported_data_set_trains_from_the_command_line_with_its_class_names(tmp_path):
    result = run_cli(
        "model=mlp", "model.hidden_sizes=[16]", "data=parquet", f"data.path={EMBEDDED}",
        "data.image_size=8", "data.eval_fraction=0.25", "trainer.batch_size=4",
        "trainer.steps=4", "trainer.log_every=2", "trainer.eval_every=4",
        "optimizer.warmup_steps=0", f"workdir={tmp_path}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "eval @ step 4: accuracy" in (tmp_path / "train.log").read_text()
    events = read_events(tmp_path)
    texts = [
        value.decode()
        for tag in events.Tags()["tensors"]
        for event in events.Tensors(tag)
        for value in event.tensor_proto.string_val
    ]
    assert any(all(name in text for name in NAMES) for text in texts), texts

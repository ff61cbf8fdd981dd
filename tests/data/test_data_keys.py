"""The size-like keys of the built-in data sets: a value that cannot make a data set is refused
in one line that starts with the key and its value and says what is valid, whether it is found
as the data set loads or earlier, when the command line sizes a model from it."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from zoo.engine.errors import ZooError

import zoo
from zoo.train import plan


@pytest.fixture(scope="module")
def parquet_file(image_folder, tmp_path_factory):
    files = sorted(image_folder.rglob("*.*"))
    classes = sorted({f.parent.name for f in files})
    table = pa.table(
        {
            "image": [f.read_bytes() for f in files],
            "label": [classes.index(f.parent.name) for f in files],
        }
    )
    path = tmp_path_factory.mktemp("parquet") / "images.parquet"
    pq.write_table(table, path)
    return path


def refused(message: str, key: str, value) -> None:
    assert message.startswith(f"data.{key}={value} must be "), message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("name", "key", "value"),
    [
        ("xor", "train_size", 0),
        ("xor", "train_size", -3),
        ("xor", "eval_size", 0),
        ("xor", "eval_size", -1),
        ("xor", "noise", float("nan")),
        ("xor", "noise", -0.5),
        ("images", "image_size", 0),
        ("images", "channels", 2),
        ("images", "workers", -1),
        ("parquet", "num_classes", 0),
    ],
)
def test_a_value_that_cannot_make_the_data_set_is_refused_by_its_key(
    name, key, value, image_folder, parquet_file
):
    path = {"images": {"path": str(image_folder)}, "parquet": {"path": str(parquet_file)}}
    with pytest.raises(ZooError) as error:
        zoo.load_data(name, **path.get(name, {}), **{key: value})
    refused(str(error.value), key, value)


@pytest.mark.parametrize(
    ("model", "name", "key", "value"),
    [
        ("mlp", "images", "image_size", 0),
        ("mlp", "parquet", "image_size", -4),
        ("cnn", "parquet", "channels", 0),
        ("mlp", "parquet", "num_classes", 0),
    ],
)
def test_a_model_is_never_sized_from_a_bad_value(
    model, name, key, value, image_folder, parquet_file, tmp_path
):
    """The command line checks every job before any runs, sizing its model from the data set
    (`input_shape`, `num_classes`): the data set's key is named, not the model's."""
    path = image_folder if name == "images" else parquet_file
    overrides = [f"model={model}", f"data={name}", f"data.path={path}", f"data.{key}={value}"]
    (job,) = plan([*overrides, f"workdir={tmp_path / 'run'}"], multirun=False)
    refused(job.error, key, value)


@pytest.mark.parametrize("name", ["chat", "preference", "prompts", "images", "parquet"])
def test_on_error_raise_is_a_value_the_command_line_takes(name):
    """`raise` is a Python keyword, yet `data.on_error=raise` is one of the key's values."""
    cfg = zoo.compose([f"data={name}", "data.on_error=raise"])
    assert cfg.data.on_error == "raise"

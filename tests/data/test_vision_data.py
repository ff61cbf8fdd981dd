"""The image data sets: readers on small files in the real formats, the checks that refuse bad
files, augment and transform, digits, and the real Fashion-MNIST where it is installed."""

from __future__ import annotations

import gzip
import io
import re
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest
from sklearn.datasets import load_digits
from zoo.data import builtin_images
from zoo.data.files import CACHE_ENV
from zoo.engine.errors import ZooError
from zoo.engine.pipeline import batches as pipeline
from zoo.engine.registry import get_data

DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    """Loaders never see the user's real cache."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))


def idx_bytes(array: np.ndarray) -> bytes:
    header = bytes([0, 0, 8, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(np.uint8).tobytes()


def write_idx_split(directory: Path, prefix: str, n: int, seed: int, gz: bool = True):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, n, dtype=np.uint8)
    paths = []
    for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
        path = directory / f"{prefix}-{kind}-ubyte{'.gz' if gz else ''}"
        path.write_bytes(gzip.compress(idx_bytes(array), mtime=0) if gz else idx_bytes(array))
        paths.append(path)
    return paths, images, labels


@pytest.mark.parametrize("gz", [True, False])
def test_idx_split_round_trips_gzipped_or_not(tmp_path, gz):
    (images_path, labels_path), images, labels = write_idx_split(tmp_path, "train", 37, 1, gz)
    split = builtin_images.read_idx_split(images_path, labels_path)
    assert split["image"].dtype == np.uint8 and split["image"].shape == (37, 28, 28, 1)
    assert split["label"].dtype == np.int32
    np.testing.assert_array_equal(split["image"][..., 0], images)
    np.testing.assert_array_equal(split["label"], labels)


def corrupt(kind: str, path: Path) -> None:
    data = path.read_bytes()
    if kind == "truncated gzip":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "bad gzip data":
        path.write_bytes(data[:20] + bytes(len(data) - 20))
    elif kind == "truncated idx":
        path.write_bytes(gzip.compress(gzip.decompress(data)[:-100]))
    elif kind == "not idx":
        path.write_bytes(gzip.compress(b"<html>Not Found</html>"))


@pytest.mark.parametrize("kind", ["truncated gzip", "bad gzip data", "truncated idx", "not idx"])
def test_a_broken_file_is_refused_naming_it(tmp_path, kind):
    (images_path, labels_path), _, _ = write_idx_split(tmp_path, "train", 30, 2)
    corrupt(kind, images_path)
    with pytest.raises(ZooError, match=re.escape(str(images_path))):
        builtin_images.read_idx_split(images_path, labels_path)


def test_images_and_labels_must_agree(tmp_path):
    (images_path, _), _, _ = write_idx_split(tmp_path, "train", 30, 3)
    (_, other_labels), _, _ = write_idx_split(tmp_path, "t10k", 20, 3)
    with pytest.raises(ZooError, match="20,.*30 images"):
        builtin_images.read_idx_split(images_path, other_labels)
    bad_labels = tmp_path / "bad-labels"
    bad_labels.write_bytes(idx_bytes(np.full(30, 10)))
    with pytest.raises(ZooError, match=f"{re.escape(str(bad_labels))} holds the label 10"):
        builtin_images.read_idx_split(images_path, bad_labels)


def test_data_dir_comes_first_and_a_partial_copy_is_refused(tmp_path):
    write_idx_split(tmp_path, "train", 40, 4)
    write_idx_split(tmp_path, "t10k", 20, 5, gz=False)
    with pytest.raises(ZooError, match="holds 40 examples, expected the 60,000"):
        get_data("fashion_mnist").splits({"dir": str(tmp_path), "download": False})


def cifar_records(images: np.ndarray, labels: np.ndarray) -> bytes:
    channels_first = images.transpose(0, 3, 1, 2).reshape(len(images), -1)
    return np.concatenate([labels[:, None].astype(np.uint8), channels_first], axis=1).tobytes()


def cifar_batches(per_batch: int = 3) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(6)
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    return {
        name: (
            rng.integers(0, 256, (per_batch, 32, 32, 3), dtype=np.uint8),
            rng.integers(0, 10, per_batch, dtype=np.uint8),
        )
        for name in names
    }


def write_cifar_archive(path: Path, batches, cut: int = 0) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, (images, labels) in batches.items():
            data = cifar_records(images, labels)
            data = data[: len(data) - cut] if name == "test_batch.bin" else data
            member = tarfile.TarInfo(f"cifar-10-batches-bin/{name}")
            member.size = len(data)
            archive.addfile(member, io.BytesIO(data))
    path.write_bytes(buffer.getvalue())


@pytest.mark.parametrize("form", ["archive", "extracted"])
def test_cifar10_round_trips_from_the_archive_or_its_directory(tmp_path, form):
    batches = cifar_batches()
    if form == "archive":
        path = tmp_path / "cifar-10-binary.tar.gz"
        write_cifar_archive(path, batches)
    else:
        path = tmp_path / "cifar-10-batches-bin"
        path.mkdir()
        for name, (images, labels) in batches.items():
            (path / name).write_bytes(cifar_records(images, labels))
    train, test = builtin_images.read_cifar10(path)
    train_names = [f"data_batch_{i}.bin" for i in range(1, 6)]
    np.testing.assert_array_equal(
        train["image"], np.concatenate([batches[n][0] for n in train_names])
    )
    np.testing.assert_array_equal(
        train["label"], np.concatenate([batches[n][1] for n in train_names])
    )
    np.testing.assert_array_equal(test["image"], batches["test_batch.bin"][0])
    assert test["image"].flags.c_contiguous and test["label"].dtype == np.int32


def test_cifar10_refuses_broken_archives_naming_them(tmp_path):
    path = tmp_path / "cifar-10-binary.tar.gz"
    write_cifar_archive(path, cifar_batches(), cut=100)
    with pytest.raises(ZooError, match=f"{re.escape(str(path))}: test_batch.bin holds 9,119 b"):
        builtin_images.read_cifar10(path)
    write_cifar_archive(path, cifar_batches())
    path.write_bytes(path.read_bytes()[:-2000])
    with pytest.raises(ZooError, match=f"Cannot read {re.escape(str(path))}"):
        builtin_images.read_cifar10(path)
    write_cifar_archive(path, {"data_batch_1.bin": cifar_batches()["data_batch_1.bin"]})
    with pytest.raises(ZooError, match="lacks data_batch_2.bin"):
        get_data("cifar10").splits({"dir": str(tmp_path), "download": False})


def images(n: int = 128, side: int = 28, channels: int = 1, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "image": rng.integers(1, 256, (n, side, side, channels), dtype=np.uint8),
        "label": np.arange(n, dtype=np.int32) % 10,
    }


def matching_view(original: np.ndarray, out: np.ndarray, padding: int) -> tuple[int, int, bool]:
    """The (top, left, mirrored) crop of the padded `original` that `out` equals."""
    side = original.shape[0]
    padded = np.pad(original, ((padding, padding), (padding, padding), (0, 0)))
    for mirrored in (False, True):
        for top in range(2 * padding + 1):
            for left in range(2 * padding + 1):
                crop = padded[top : top + side, left : left + side]
                if np.array_equal(crop[:, ::-1] if mirrored else crop, out):
                    return top, left, mirrored
    raise AssertionError("the augmented image is no crop of the padded original")


@pytest.mark.parametrize(("flip", "channels"), [(False, 1), (True, 1), (True, 3)])
def test_augment_crops_and_flips_each_image_its_own_way(flip, channels):
    batch = images(channels=channels)
    out = builtin_images.CropAndFlip(2, flip)(batch, np.random.default_rng(0))
    assert out["image"].shape == batch["image"].shape and out["image"].dtype == np.uint8
    assert out["label"] is batch["label"]
    views = [matching_view(a, b, 2) for a, b in zip(batch["image"], out["image"], strict=True)]
    assert len({(top, left) for top, left, _ in views}) == 25
    assert {mirrored for _, _, mirrored in views} == ({False, True} if flip else {False})


def test_augment_is_a_function_of_the_generator():
    batch = images(side=32, channels=3)
    augment = builtin_images.CropAndFlip(4, True)

    def run(seed):
        return augment(batch, np.random.default_rng(seed))["image"]

    np.testing.assert_array_equal(run(1), run(1))
    assert not np.array_equal(run(1), run(2))


@pytest.mark.parametrize("channels", [1, 3])
def test_normalize_maps_pixels_per_channel(channels):
    mean, std = (0.5, 0.25, 0.0)[:channels], (0.5, 0.125, 2.0)[:channels]
    batch = {**images(n=4, side=5, channels=channels), "mask": np.ones(4, np.float32)}
    out = builtin_images.Normalize(255, mean, std)(batch)
    assert out["image"].dtype == np.float32 and out["mask"] is batch["mask"]
    expected = (batch["image"] / 255 - np.array(mean)) / np.array(std)
    np.testing.assert_allclose(out["image"], expected, rtol=1e-5, atol=1e-6)


def test_crop_padding_out_of_range_is_refused():
    with pytest.raises(ZooError, match=r"data.crop_padding=5 .* between 0 and 4"):
        get_data("digits").splits({"crop_padding": 5})


@pytest.fixture(scope="module")
def digits():
    return get_data("digits").splits({"augment": True})


def test_digits_has_the_documented_split(digits):
    assert len(digits.train["label"]) == 1437 and len(digits.eval["label"]) == 360
    for split in (digits.train, digits.eval):
        assert split["image"].dtype == np.uint8 and split["image"].shape[1:] == (8, 8, 1)
        assert split["image"].max() == 16 and split["label"].dtype == np.int32
        assert set(np.unique(split["label"])) == set(range(10))
    again = get_data("digits").splits({})
    np.testing.assert_array_equal(again.eval["image"], digits.eval["image"])
    # The rows are scikit-learn's own, though zoo reads its file without importing it.
    bunch = load_digits()
    order = np.random.default_rng(0).permutation(1797)
    np.testing.assert_array_equal(again.train["image"][..., 0], bunch.images[order[:1437]])
    np.testing.assert_array_equal(again.eval["label"], bunch.target[order[1437:]])
    assert again.augment is None and isinstance(digits.augment, builtin_images.CropAndFlip)
    normalized = digits.transform(dict(digits.train))["image"]
    assert normalized.dtype == np.float32
    assert abs(normalized.mean()) < 0.01 and abs(normalized.std() - 1) < 0.01


def test_augmented_batches_repeat_per_seed_and_resume_exactly(digits):
    def stream(seed):
        return pipeline.train_batches(
            digits.train, 64, seed, transform=digits.transform, augment=digits.augment
        )

    first, again, other = (iter(stream(s)) for s in (3, 3, 4))
    for _ in range(4):
        batch = next(first)
        assert batch["image"].dtype == np.float32 and batch["image"].shape == (64, 8, 8, 1)
        np.testing.assert_array_equal(batch["image"], next(again)["image"])
        assert not np.array_equal(batch["image"], next(other)["image"])
    state = first.get_state()
    expected = [next(first)["image"] for _ in range(3)]
    resumed = iter(stream(3))
    resumed.set_state(state)
    for want in expected:
        np.testing.assert_array_equal(next(resumed)["image"], want)


def test_every_image_data_set_tells_models_its_shape():
    shapes = {"digits": (8, 8, 1), "mnist": (28, 28, 1), "fashion_mnist": (28, 28, 1)}
    for name, shape in {**shapes, "cifar10": (32, 32, 3)}.items():
        assert get_data(name).info == {"input_shape": shape, "num_classes": 10}


@pytest.mark.skipif(
    not DEBIAN_FASHION_MNIST.is_dir(),
    reason=f"no {DEBIAN_FASHION_MNIST}: Debian's package dataset-fashion-mnist provides it",
)
def test_real_fashion_mnist_from_the_debian_package():
    splits = get_data("fashion_mnist").splits({"download": False})
    for split, size in ((splits.train, 60_000), (splits.eval, 10_000)):
        assert split["image"].shape == (size, 28, 28, 1) and split["image"].dtype == np.uint8
        np.testing.assert_array_equal(np.bincount(split["label"]), [size // 10] * 10)
    normalized = splits.transform({"image": splits.train["image"][::10]})["image"]
    assert abs(normalized.mean()) < 0.01 and abs(normalized.std() - 1) < 0.01

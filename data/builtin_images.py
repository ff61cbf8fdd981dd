"""The built-in image data sets: scikit-learn's 8x8 digits, MNIST, Fashion-MNIST and CIFAR-10.

Every split holds `image` (uint8, N x H x W x C) and `label` (int32, N). Pixels stay uint8 in
memory (a quarter of the float32 size) and become float32 one batch at a time: the `transform`
computes `(x / max - mean) / std` with the training split's per-channel statistics (or, with
`normalize=False`, only `x / max`, intensities in [0, 1]). The
`augment` step (training batches only, before the transform) pads each image and crops it back
at a random offset, and mirrors it left-right where a mirrored image is still of its class
(clothes, objects; not digits).

The files of MNIST, Fashion-MNIST and CIFAR-10 are found or fetched by `zoo.data.files`; their
loaders' `dir` names a directory to look in first, `download=False` forbids downloading, and
`mirror` is a base URL to download from in place of the published ones.
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import math
import struct
import tarfile
import zlib
from pathlib import Path, PurePosixPath

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from zoo.data.files import FileSource, RemoteFile, find_or_fetch

from zoo.plugin import Batch, Splits, ZooError, register_data


@dataclasses.dataclass(frozen=True)
class Normalize:
    """Batch transform: `image` (uint8) -> float32 `(x / max_value - mean) / std` per channel;
    the other columns pass through."""

    max_value: float
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __call__(self, batch: Batch) -> Batch:
        image = batch["image"].astype(np.float32)
        std = np.asarray(self.std, np.float32)
        scale, shift = 1 / (self.max_value * std), np.asarray(self.mean, np.float32) / std
        if len(std) == 1:
            image *= scale[0]
            image -= shift[0]
        else:  # numpy is slow to broadcast along a short last axis: tile along whole rows
            width = image.shape[-2]
            rows = image.reshape(-1, width * len(std))
            rows *= np.tile(scale, width)
            rows -= np.tile(shift, width)
        return {**batch, "image": image}

    def choose(self, normalize: bool) -> Normalize:
        """Itself, or with `normalize=False` the plain scaling to [0, 1] (`x / max_value`) that
        models of pixel intensities (a VAE's Bernoulli decoder) need."""
        plain = Normalize(self.max_value, (0.0,) * len(self.std), (1.0,) * len(self.std))
        return self if normalize else plain


@dataclasses.dataclass(frozen=True)
class CropAndFlip:
    """Batch augment: pad every image by `padding` black pixels, crop it back to its size at a
    random offset of its own and, with `flip`, mirror it left-right with probability 1/2."""

    padding: int
    flip: bool

    def __call__(self, batch: Batch, rng: np.random.Generator) -> Batch:
        image = batch["image"]
        n, height, width, channels = image.shape
        p = self.padding
        padded = np.zeros((n, height + 2 * p, width + 2 * p, channels), image.dtype)
        padded[:, p : p + height, p : p + width] = image
        # Each pixel as one opaque item of all its channels, so every gather moves whole pixels.
        pixels = padded.view(np.dtype((np.void, channels * image.itemsize)))[..., 0]
        top, left = rng.integers(0, 2 * p + 1, size=(2, n))
        windows = sliding_window_view(pixels, (height, width), axis=(1, 2))
        cropped = windows[np.arange(n), top, left]
        if self.flip:
            mirrored = rng.random(n) < 0.5
            cropped[mirrored] = cropped[mirrored, :, ::-1]
        return {**batch, "image": cropped[..., None].view(image.dtype).reshape(image.shape)}


def _crop_and_flip(augment: bool, crop_padding: int, flip: bool, side: int) -> CropAndFlip | None:
    if not 0 <= crop_padding <= side // 2:
        raise ZooError(
            f"data.crop_padding={crop_padding} is out of range: it must be between 0 and "
            f"{side // 2} (half the side of these {side}x{side} images)."
        )
    if not augment or (crop_padding == 0 and not flip):
        return None
    return CropAndFlip(crop_padding, flip)


# ---- IDX files (MNIST, Fashion-MNIST) ----


def _read_bytes(path: Path) -> bytes:
    """The file's content, gunzipped if it is a gzip file (told by its content, not its name)."""
    try:
        data = path.read_bytes()
        return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
    except (OSError, EOFError, zlib.error) as e:
        raise ZooError(
            f"Cannot read {path} ({e or type(e).__name__}): it is corrupt or truncated. "
            "Delete it and get it again, or point data.dir at a good copy."
        ) from None


def read_idx(path: Path) -> np.ndarray:
    """The array in an IDX file of unsigned bytes, gzipped or not; its header must account for
    every byte of it, so a truncated file is refused."""
    data = _read_bytes(path)
    ndim = data[3] if len(data) >= 4 else 0
    if data[:3] != b"\x00\x00\x08" or ndim == 0 or len(data) < 4 + 4 * ndim:
        raise ZooError(
            f"{path} is not an IDX file of unsigned bytes: it starts with {data[:8].hex()}, "
            "expected 00 00 08 then the number of dimensions and their sizes."
        )
    offset = 4 + 4 * ndim
    shape = struct.unpack(f">{ndim}I", data[4:offset])
    if len(data) - offset != math.prod(shape):
        raise ZooError(
            f"{path} is truncated or corrupt: its header announces an array of shape {shape} "
            f"({math.prod(shape):,} bytes), but {len(data) - offset:,} bytes follow it."
        )
    return np.frombuffer(data, np.uint8, offset=offset).reshape(shape)


def read_idx_split(images_path: Path, labels_path: Path) -> dict[str, np.ndarray]:
    """One split from a pair of IDX files: N 28x28 images and N labels 0..9."""
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3 or images.shape[1:] != (28, 28):
        raise ZooError(
            f"{images_path} holds an array of shape {images.shape}; expected N 28x28 images."
        )
    if labels.shape != (len(images),):
        raise ZooError(
            f"{labels_path} holds an array of shape {labels.shape}, but {images_path} holds "
            f"{len(images):,} images: expected one label per image, from the same split."
        )
    return {"image": images[..., None], "label": _labels(labels, labels_path)}


def _labels(labels: np.ndarray, where: Path | str) -> np.ndarray:
    if labels.size and labels.max() > 9:
        raise ZooError(f"{where} holds the label {labels.max()}; expected labels 0..9.")
    return labels.astype(np.int32)


_IDX_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)
_IDX_SPLITS = {"train": (*_IDX_FILES[:2], 60_000), "eval": (*_IDX_FILES[2:], 10_000)}
"""Split -> (images file, labels file, number of examples)."""


def _idx_source(
    name: str,
    base_urls: tuple[str, ...],
    sha256: tuple[str, ...],
    system_dir: str | None = None,
    system_package: str | None = None,
) -> FileSource:
    """The four IDX files, each also accepted unpacked; `sha256` in the order of `_IDX_FILES`."""
    files = tuple(
        RemoteFile(file, digest, (file.removesuffix(".gz"),))
        for file, digest in zip(_IDX_FILES, sha256, strict=True)
    )
    return FileSource(name, files, base_urls, system_dir, system_package)


MNIST_FILES = _idx_source(
    "mnist",
    ("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/"),
    (
        "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
        "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
        "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
        "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
    ),
)

FASHION_MNIST_FILES = _idx_source(
    "fashion_mnist",
    ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",),
    (
        "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84",
        "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845",
        "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073",
        "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5",
    ),
    system_dir="/usr/share/datasets/fashion-mnist",
    system_package="dataset-fashion-mnist",
)


def _load_idx(
    source: FileSource, directory: str | None, download: bool, mirror: str | None
) -> dict[str, dict[str, np.ndarray]]:
    paths = find_or_fetch(source, directory, download, mirror)
    splits = {}
    for split, (images, labels, size) in _IDX_SPLITS.items():
        splits[split] = read_idx_split(paths[images], paths[labels])
        _check_size(splits[split], size, source.name, split, paths[images])
    return splits


def _check_size(
    columns: dict[str, np.ndarray], size: int, name: str, split: str, where: Path
) -> None:
    if len(columns["label"]) != size:
        raise ZooError(
            f"{where} holds {len(columns['label']):,} examples, expected the {size:,} of the "
            f"full {name} {split} split: it is another data set's file or a partial copy."
        )


# ---- CIFAR-10, binary version ----

_CIFAR_TRAIN = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
_CIFAR_TEST = "test_batch.bin"
_CIFAR_RECORD = 1 + 32 * 32 * 3

CIFAR10_FILES = FileSource(
    "cifar10",
    (
        RemoteFile(
            "cifar-10-binary.tar.gz",
            "c4a38c50a1bc5f3a1c5537f2155ab9d68f9f25eb1ed8d9ddda3db29a59bca1dd",
            ("cifar-10-batches-bin",),
        ),
    ),
    ("https://www.cs.toronto.edu/~kriz/",),
)


def read_cifar10(path: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(train, test) from the binary CIFAR-10 archive, or the directory it extracts to. The
    archive's members are read in memory: nothing is extracted to disk."""
    wanted = {*_CIFAR_TRAIN, _CIFAR_TEST}
    members = _directory_members(path, wanted) if path.is_dir() else _tar_members(path, wanted)
    batches = {name: _cifar_records(members[name], f"{path}: {name}") for name in wanted}
    train = {
        column: np.concatenate([batches[name][column] for name in _CIFAR_TRAIN])
        for column in ("image", "label")
    }
    test = {column: np.ascontiguousarray(values) for column, values in batches[_CIFAR_TEST].items()}
    return train, test


def _directory_members(directory: Path, names: set[str]) -> dict[str, bytes]:
    missing = sorted(name for name in names if not (directory / name).is_file())
    if missing:
        raise ZooError(
            f"{directory} lacks {', '.join(missing)}: expected the directory that "
            "cifar-10-binary.tar.gz extracts to."
        )
    try:
        return {name: (directory / name).read_bytes() for name in names}
    except OSError as e:
        raise ZooError(f"Cannot read the CIFAR-10 files in {directory} ({e}).") from None


def _tar_members(path: Path, names: set[str]) -> dict[str, bytes]:
    members = {}
    try:
        with tarfile.open(path, "r:*") as archive:
            for member in archive:
                name = PurePosixPath(member.name).name
                if name in names and member.isfile():
                    members[name] = archive.extractfile(member).read()
    except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
        raise ZooError(
            f"Cannot read {path} ({e or type(e).__name__}): it is not a readable tar archive, "
            "or it is corrupt or truncated. Delete it and get it again, or point data.dir at a "
            "good copy."
        ) from None
    missing = sorted(names - members.keys())
    if missing:
        raise ZooError(
            f"{path} lacks {', '.join(missing)}: expected the binary version of CIFAR-10 "
            "(cifar-10-binary.tar.gz)."
        )
    return members


def _cifar_records(data: bytes, where: str) -> dict[str, np.ndarray]:
    if not data or len(data) % _CIFAR_RECORD:
        raise ZooError(
            f"{where} holds {len(data):,} bytes, not a whole number of {_CIFAR_RECORD:,}-byte "
            "CIFAR-10 records (a label byte, then 32x32 pixels of each of R, G, B): it is "
            "truncated or not CIFAR-10 binary data."
        )
    records = np.frombuffer(data, np.uint8).reshape(-1, _CIFAR_RECORD)
    images = records[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return {"image": images, "label": _labels(records[:, 0], where)}


# ---- The registered data sets ----

DIGITS_EVAL_SIZE = 360
DIGITS_SPLIT_SEED = 0

DIGITS_NORMALIZE = Normalize(16, (0.3054,), (0.3760,))
MNIST_NORMALIZE = Normalize(255, (0.1307,), (0.3081,))
FASHION_MNIST_NORMALIZE = Normalize(255, (0.2860,), (0.3530,))
CIFAR10_NORMALIZE = Normalize(255, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))


@register_data("digits", input_shape=(8, 8, 1), num_classes=10)
def digits(
    # Augment the training images: a random crop after padding (digits are never mirrored).
    augment: bool = False,
    # Black pixels padded on each side before the random crop (0: no crop; at most half the side).
    crop_padding: int = 1,
    # `(x / max - mean) / std` with the training split's per-channel statistics; false: `x / max`
    # only, intensities in [0, 1].
    normalize: bool = True,
) -> Splits:
    """scikit-learn's 1,797 handwritten 8x8 digits (pixel values 0..16), bundled with it, so
    always available offline. The split is fixed: the rows of `load_digits()` in the order of
    `numpy.random.default_rng(0).permutation(1797)`, the first 1,437 for training, the last 360
    for evaluation."""
    crop_and_flip = _crop_and_flip(augment, crop_padding, flip=False, side=8)
    table = _digits_table()
    order = np.random.default_rng(DIGITS_SPLIT_SEED).permutation(len(table))
    images = table[order, :-1].reshape(-1, 8, 8, 1).astype(np.uint8)
    labels = table[order, -1].astype(np.int32)
    cut = len(order) - DIGITS_EVAL_SIZE
    return Splits(
        train={"image": images[:cut], "label": labels[:cut]},
        eval={"image": images[cut:], "label": labels[cut:]},
        transform=DIGITS_NORMALIZE.choose(normalize),
        augment=crop_and_flip,
    )


def _digits_table() -> np.ndarray:
    """The rows of scikit-learn's `digits.csv.gz` (64 pixels, then the label), read as its
    `load_digits()` reads them, without importing scikit-learn: that takes about 1.5 s (scipy,
    pandas) of every run's start, for one small file."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without running it
    if spec is None or not spec.submodule_search_locations:
        raise ZooError("The data set digits is scikit-learn's, and scikit-learn is not installed.")
    path = Path(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz")
    with gzip.open(path, mode="rt", encoding="utf-8") as rows:
        return np.loadtxt(rows, delimiter=",")


@register_data("mnist", input_shape=(28, 28, 1), num_classes=10)
def mnist(
    # A directory to look in for the data set's files before the cache and a download; null: none.
    dir: str | None = None,
    # Download missing files into the cache; false: a missing file is an error.
    download: bool = True,
    # Base URL serving the same file names, to download from; null: the published ones.
    mirror: str | None = None,
    # Augment the training images: a random crop after padding (digits are never mirrored).
    augment: bool = False,
    # Black pixels padded on each side before the random crop (0: no crop; at most half the side).
    crop_padding: int = 2,
    # `(x / max - mean) / std` with the training split's per-channel statistics; false: `x / max`
    # only, intensities in [0, 1].
    normalize: bool = True,
) -> Splits:
    """MNIST's handwritten digits: 60,000 training and 10,000 test 28x28 grey images. Digits
    are never mirrored: a mirrored digit is not the same digit."""
    crop_and_flip = _crop_and_flip(augment, crop_padding, flip=False, side=28)
    splits = _load_idx(MNIST_FILES, dir, download, mirror)
    return Splits(
        train=splits["train"],
        eval=splits["eval"],
        transform=MNIST_NORMALIZE.choose(normalize),
        augment=crop_and_flip,
    )


FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
CIFAR10_CLASSES = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)


@register_data(
    "fashion_mnist", input_shape=(28, 28, 1), num_classes=10, class_names=FASHION_MNIST_CLASSES
)
def fashion_mnist(
    # A directory to look in for the data set's files before the cache and a download; null: none.
    dir: str | None = None,
    # Download missing files into the cache; false: a missing file is an error.
    download: bool = True,
    # Base URL serving the same file names, to download from; null: the published ones.
    mirror: str | None = None,
    # Augment the training images: a random crop after padding, and a left-right flip.
    augment: bool = False,
    # Black pixels padded on each side before the random crop (0: no crop; at most half the side).
    crop_padding: int = 2,
    flip: bool = True,  # with augment: mirror half the training images left-right
    # `(x / max - mean) / std` with the training split's per-channel statistics; false: `x / max`
    # only, intensities in [0, 1].
    normalize: bool = True,
) -> Splits:
    """Zalando's Fashion-MNIST: 60,000 training and 10,000 test 28x28 grey images of clothes in
    10 classes, a drop-in for MNIST that is harder to fit."""
    crop_and_flip = _crop_and_flip(augment, crop_padding, flip, side=28)
    splits = _load_idx(FASHION_MNIST_FILES, dir, download, mirror)
    return Splits(
        train=splits["train"],
        eval=splits["eval"],
        transform=FASHION_MNIST_NORMALIZE.choose(normalize),
        augment=crop_and_flip,
    )


@register_data("cifar10", input_shape=(32, 32, 3), num_classes=10, class_names=CIFAR10_CLASSES)
def cifar10(
    # A directory to look in for the data set's files before the cache and a download; null: none.
    dir: str | None = None,
    # Download missing files into the cache; false: a missing file is an error.
    download: bool = True,
    # Base URL serving the same file names, to download from; null: the published ones.
    mirror: str | None = None,
    # Augment the training images: a random crop after padding, and a left-right flip.
    augment: bool = True,
    # Black pixels padded on each side before the random crop (0: no crop; at most half the side).
    crop_padding: int = 4,
    flip: bool = True,  # with augment: mirror half the training images left-right
    # `(x / max - mean) / std` with the training split's per-channel statistics; false: `x / max`
    # only, intensities in [0, 1].
    normalize: bool = True,
) -> Splits:
    """CIFAR-10: 50,000 training and 10,000 test 32x32 colour images in 10 classes. Augmented
    by default, as small models overfit it within a few epochs otherwise."""
    crop_and_flip = _crop_and_flip(augment, crop_padding, flip, side=32)
    paths = find_or_fetch(CIFAR10_FILES, dir, download, mirror)
    archive = paths["cifar-10-binary.tar.gz"]
    train, test = read_cifar10(archive)
    _check_size(train, 50_000, "cifar10", "train", archive)
    _check_size(test, 10_000, "cifar10", "eval", archive)
    return Splits(
        train=train,
        eval=test,
        transform=CIFAR10_NORMALIZE.choose(normalize),
        augment=crop_and_flip,
    )

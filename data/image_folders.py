"""`data=images data.path=DIR`: a folder of image files, one subfolder per class.

The layout is torchvision's `ImageFolder`: `DIR/<class>/**/<image>`, the classes sorted by name
(label 0 is the first). When `DIR` holds both `train/` and `val/`, they are the two splits (the
classes are `train/`'s); otherwise each class's `data.eval_fraction` is held out by a fixed
seed. Files are taken by extension (`.jpg .jpeg .png .webp .bmp`, any case); others are ignored.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from zoo.data.image_examples import Augment, Files, Subset, readable
from zoo.data.image_options import ImageOptions, held_out, image_splits

from zoo.plugin import Splits, ZooError, register_data

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")


def _root(path: str | None) -> Path:
    if path is None or not Path(path).expanduser().is_dir():
        raise ZooError(
            f"data.path={path} is not a directory: data=images needs data.path=DIR, a folder "
            "with one subfolder of images per class (or train/ and val/ folders of them)."
        )
    return Path(path).expanduser()


def _split_dirs(root: Path) -> tuple[Path, Path | None]:
    """(the training folder, the eval folder or None)."""
    if (root / "train").is_dir() and (root / "val").is_dir():
        return root / "train", root / "val"
    return root, None


def class_names(folder: Path) -> list[str]:
    names = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not names:
        raise ZooError(
            f"{folder} has no subfolders: data=images needs one subfolder of images per class "
            "(e.g. DIR/cat/1.jpg, DIR/dog/2.jpg)."
        )
    return names


def scan(folder: Path, classes: list[str], required: bool = True) -> tuple[list[str], np.ndarray]:
    """(paths, labels) of the image files under each class folder, sorted."""
    paths, labels = [], []
    for label, name in enumerate(classes):
        found = sorted(
            str(p)
            for p in (folder / name).rglob("*")
            if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file()
        )
        if not found and required:
            raise ZooError(
                f"The class folder {folder / name} holds no image files "
                f"({', '.join(IMAGE_EXTENSIONS)}): put images in it, or remove it."
            )
        paths += found
        labels += [label] * len(found)
    return paths, np.asarray(labels, np.int32)


def _check_val_classes(val: Path, classes: list[str]) -> None:
    extra = sorted(set(class_names(val)) - set(classes))
    if extra:
        raise ZooError(
            f"{val} has class folders that {val.parent / 'train'} lacks: {', '.join(extra)}. "
            "Both splits must use the training classes."
        )


def describe_images(path: str | None = None, **keys) -> dict:
    options = ImageOptions.of(keys)
    train, _val = _split_dirs(_root(path))
    return {"input_shape": options.input_shape, "num_classes": len(class_names(train))}


@register_data("images", describe=describe_images)
def images(
    # The folder: a subfolder of images per class, or `train/` and `val/` folders of them
    # (required).
    path: str | None = None,
    *,
    options: ImageOptions,
) -> Splits:
    """A folder of images, one subfolder per class (see the module's doc). Images become
    `image_size` x `image_size` x `channels` (1: grey, 3: RGB), normalised by the training
    images' per-channel statistics (`dataset`), ImageNet's (`imagenet`), or only scaled to
    [0, 1] (`none`: for a model that normalises its inputs itself, as pretrained ones do);
    `workers` processes decode and augment the training batches."""
    train_dir, val_dir = _split_dirs(_root(path))
    classes = class_names(train_dir)
    paths, labels = scan(train_dir, classes)
    if val_dir is not None:
        _check_val_classes(val_dir, classes)
        val_paths, val_labels = scan(val_dir, classes, required=False)
        train_files, test_files = Files(paths), Files(val_paths)
    else:
        train_rows, test_rows = held_out(labels, options.eval_fraction)
        train_files, test_files = Subset(Files(paths), train_rows), Subset(Files(paths), test_rows)
        labels, val_labels = labels[train_rows], labels[test_rows]
    kept = readable(train_files, options.on_error, str(train_dir))
    kept_test = readable(test_files, options.on_error, str(val_dir or train_dir))
    if not kept or not kept_test:
        raise ZooError(f"data.path={path}: no readable image is left in one of the splits.")
    train = options.examples(Subset(train_files, kept), labels[kept], options.augment)
    test = options.examples(Subset(test_files, kept_test), val_labels[kept_test], Augment.none)
    return image_splits(train, test, options, paths, classes)

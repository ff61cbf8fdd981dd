"""Small image data sets written by the tests: real JPEG/PNG/WebP/BMP files in every mode
Pillow saves, ArrayRecord shards and Parquet files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = ("ant", "bee", "cat")
FORMATS = ("jpg", "png", "webp", "bmp")
MODES = ("RGB", "L", "RGBA", "P", "CMYK")
SAVES = {
    "jpg": ("RGB", "L", "CMYK"),
    "png": MODES[:4],
    "webp": ("RGB", "RGBA"),
    "bmp": ("RGB", "L", "P"),
}


RUN_STEPS = 24
RUN_ARGS = (
    "model=mlp",
    "model.hidden_sizes=[16]",
    "data=images",
    "data.image_size=16",
    "trainer.batch_size=16",
    f"trainer.steps={RUN_STEPS}",
    "trainer.log_every=4",
    "trainer.checkpoint_every=4",
    "trainer.eval_every=0",
    "logging.norms_every=0",
    "optimizer.warmup_steps=0",
)
"""A small run on an image folder (`data.path` to add), checkpointed every 4 steps."""


def picture(label: int, index: int, size=(20, 24)) -> np.ndarray:
    """A picture its class can be told from: a bright band whose position is the class."""
    rng = np.random.default_rng([label, index])
    pixels = rng.integers(0, 60, (*size, 3)).astype(np.uint8)
    band = size[0] // len(CLASSES)
    pixels[label * band : (label + 1) * band] += 180
    return pixels


def write_folder(root: Path, per_class: int = 12, classes=CLASSES) -> list[Path]:
    """`root/<class>/<i>.<ext>`, formats and modes in turn; the paths written."""
    written = []
    for label, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            ext = FORMATS[i % len(FORMATS)]
            modes = SAVES[ext]
            image = Image.fromarray(picture(label, i)).convert(modes[i % len(modes)])
            path = root / name / f"{i}.{ext}"
            image.save(path)
            written.append(path)
    return written

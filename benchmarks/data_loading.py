"""Loading an image folder: zoo's Grain pipeline against PyTorch's DataLoader, same work.

    python -m benchmarks.data_loading --images 20000 --rounds 7 --batches 20 --json out.json

An image folder of `--images` generated JPEGs (`--width` x `--height`, 10 classes, quality
90) is written once into `--cache` (outside the repository). Both pipelines decode each image
with Pillow, take a random-resized crop (torchvision's sampling), resized bilinearly to
`--image-size`, flip half of them, and normalise them into float32 batches of `--batch-size`,
with 0, 1 and 2 worker processes. PyTorch's side is a `Dataset` whose `__getitem__` does those
steps with PIL and numpy (torchvision cannot be installed beside the CPU torch here), batched
by a `DataLoader` (shuffled). Each run times `--batches` batches after its first (so neither
side's worker start-up counts); runs alternate between the two, round after round; images/s
are medians over the rounds, zoo/torch the median of each round's ratio.

Also measured: the time to restore zoo's iterator at a saved position (`set_state`, then the
first batch: worker start-up included), and `vitals/data_wait_share` of a `cnn` trained on the
folder with 2 workers (the share of the loop's time spent waiting for batches).

Needs torch (the `bench` extra, or `pip install torch==2.13.0`); zoo never imports it.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image
from zoo.data.files import cache_root
from zoo.engine.pipeline import batches as pipeline

WORKERS = (0, 1, 2)


def write_images(root: Path, count: int, width: int, height: int) -> Path:
    """`count` JPEGs in 10 class folders, written once (a `done` file marks a whole set)."""
    folder = root / f"jpeg-{count}-{width}x{height}"
    if (folder / "done").exists():
        return folder
    rng = np.random.default_rng(0)
    for i in range(count):
        label = i % 10
        (folder / f"class{label}").mkdir(parents=True, exist_ok=True)
        # Smooth shapes, not noise: JPEGs of the size and decode cost of photos.
        coarse = rng.integers(0, 256, (height // 16 + 1, width // 16 + 1, 3)).astype(np.uint8)
        image = Image.fromarray(coarse).resize((width, height), Image.BICUBIC)
        image.save(folder / f"class{label}" / f"{i:06d}.jpg", quality=90)
    (folder / "done").touch()
    return folder


# ---- PyTorch's side: the same steps with PIL and numpy ----


def torch_loader(folder: Path, size: int, batch_size: int, workers: int, mean, std):
    import torch
    from torch.utils.data import DataLoader, Dataset

    files = sorted(folder.glob("class*/*.jpg"))
    labels = [int(f.parent.name.removeprefix("class")) for f in files]
    mean32, std32 = np.asarray(mean, np.float32), np.asarray(std, np.float32)

    class Folder(Dataset):
        def __len__(self):
            return len(files)

        def __getitem__(self, index):
            image = Image.open(files[index]).convert("RGB")
            width, height = image.size
            box = _crop_box(width, height)
            image = image.resize((size, size), Image.BILINEAR, box=box)
            if random.random() < 0.5:
                image = image.transpose(Image.FLIP_LEFT_RIGHT)
            pixels = (np.asarray(image, np.float32) / 255 - mean32) / std32
            return torch.from_numpy(pixels), labels[index]

    return DataLoader(Folder(), batch_size=batch_size, shuffle=True, num_workers=workers)


def _crop_box(width: int, height: int) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop sampling (scale 0.08..1, ratio 3/4..4/3)."""
    area = width * height
    for _ in range(10):
        target = area * random.uniform(0.08, 1.0)
        ratio = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            top, left = random.randint(0, height - h), random.randint(0, width - w)
            return left, top, left + w, top + h
    return 0, 0, width, height


# ---- zoo's side ----


def zoo_splits(folder: Path, size: int):
    from zoo.engine.registry import get_data

    return get_data("images").splits(
        {"path": str(folder), "image_size": size, "eval_fraction": 0.01}
    )


def zoo_batches(splits, batch_size: int, workers: int):
    return pipeline.train_batches(
        splits.train, batch_size, seed=0, transform=splits.transform, workers=workers
    )


def images_per_sec(iterator, batches: int, batch_size: int, workers: int) -> float:
    """Images/s over `batches` batches, after the first 1 + 2 x workers (start-up: every
    worker has made a batch)."""
    for _ in range(1 + 2 * workers):
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return batches * batch_size / (time.perf_counter() - start)


def zoo_run(splits, args, workers: int) -> float:
    iterator = iter(zoo_batches(splits, args.batch_size, workers))
    try:
        return images_per_sec(iterator, args.batches, args.batch_size, workers)
    finally:
        iterator.close()


def torch_run(folder: Path, args, workers: int, mean, std) -> float:
    loader = torch_loader(folder, args.image_size, args.batch_size, workers, mean, std)
    iterator = iter(loader)
    try:
        return images_per_sec(iterator, args.batches, args.batch_size, workers)
    finally:
        del iterator  # shuts the DataLoader's workers down


def restore_seconds(splits, args, workers: int) -> float:
    """`set_state` at batch 1,000, then the first batch (worker start-up included)."""
    iterator = iter(zoo_batches(splits, args.batch_size, workers))
    try:
        start = time.perf_counter()
        iterator.set_state({"next_index": 1000})
        next(iterator)
        return time.perf_counter() - start
    finally:
        iterator.close()


def data_wait_share(folder: Path, args) -> dict:
    """`vitals/data_wait_share` of a cnn on the folder with 2 workers, windows after the first."""
    import zoo
    from benchmarks.loops import data_wait_shares

    with tempfile.TemporaryDirectory() as workdir:
        zoo.fit(
            "cnn",
            "data=images",
            f"data.path={folder}",
            f"data.image_size={args.image_size}",
            "data.eval_fraction=0.01",
            "data.workers=2",
            f"trainer.batch_size={args.batch_size}",
            f"trainer.steps={args.train_steps}",
            "trainer.log_every=10",
            "trainer.eval_every=0",
            "trainer.checkpoint_every=0",
            "optimizer.warmup_steps=0",
            f"workdir={workdir}",
        )
        shares = data_wait_shares(workdir)
    return {"median": statistics.median(shares), "min": min(shares), "max": max(shares)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=20_000)
    parser.add_argument("--width", type=int, default=160)
    parser.add_argument("--height", type=int, default=120)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--train-steps", type=int, default=60)
    parser.add_argument("--cache", type=Path, default=cache_root() / "benchmark-images")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    started = time.perf_counter()
    folder = write_images(args.cache, args.images, args.width, args.height)
    written = time.perf_counter() - started
    splits = zoo_splits(folder, args.image_size)
    mean, std = splits.transform.mean, splits.transform.std
    rates: dict[str, dict[int, list[float]]] = {"zoo": {}, "torch": {}}
    for _ in range(args.rounds):
        for workers in WORKERS:
            rates["zoo"].setdefault(workers, []).append(zoo_run(splits, args, workers))
            rates["torch"].setdefault(workers, []).append(
                torch_run(folder, args, workers, mean, std)
            )
    report = {
        "settings": {k: str(v) for k, v in vars(args).items()},
        "folder": str(folder),
        "seconds_to_prepare_folder": written,
        "images_per_sec": {
            side: {str(w): statistics.median(r) for w, r in by.items()}
            for side, by in rates.items()
        },
        "runs": {side: {str(w): r for w, r in by.items()} for side, by in rates.items()},
        "restore_seconds": {str(w): restore_seconds(splits, args, w) for w in (0, 2)},
        "data_wait_share_cnn_2_workers": data_wait_share(folder, args),
    }
    # Ratios round by round (the two runs of a round are back to back), then their median:
    # less sensitive to other work on the machine than a ratio of medians.
    report["zoo_over_torch"] = {
        str(w): statistics.median(
            z / t for z, t in zip(rates["zoo"][w], rates["torch"][w], strict=True)
        )
        for w in WORKERS
    }
    print(
        f"{args.images:,} JPEGs {args.width}x{args.height} -> {args.image_size}x{args.image_size}, batch {args.batch_size}, median of {args.rounds} runs"
    )
    print(f"{'workers':<8} {'zoo img/s':>10} {'torch img/s':>12} {'zoo/torch':>10}")
    for w in WORKERS:
        zoo_rate, torch_rate = (report["images_per_sec"][s][str(w)] for s in ("zoo", "torch"))
        ratio = report["zoo_over_torch"][str(w)]
        print(f"{w:<8} {zoo_rate:>10,.0f} {torch_rate:>12,.0f} {ratio:>10.2f}")
    for w, seconds in report["restore_seconds"].items():
        print(f"restore the iterator at batch 1,000 with {w} workers: {seconds:.2f} s")
    share = report["data_wait_share_cnn_2_workers"]
    print(f"cnn, 2 workers: vitals/data_wait_share median {share['median']:.3f}")
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

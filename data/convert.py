"""An image folder into ArrayRecord shards, for fast repeated reading (`data=arrayrecord`).

`python -m zoo.data convert images DIR OUT` writes, for each split of `DIR` (its `train/` and
`val/`, or the folder itself), shards `OUT[/train|/val]/images-NNNNN-of-MMMMM.array_record`.
Each record is a msgpack map `{"image": <the file's bytes, as they are>, "label": <class name>,
"name": <the file's path under DIR>}`; files that are not images are left out, each named.
A shard is written under a temporary name and renamed once complete.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import msgpack
from array_record.python.array_record_module import ArrayRecordWriter
from zoo.data.image_examples import Files, OnError, readable
from zoo.data.image_folders import class_names, scan

from zoo.plugin import ZooError

log = logging.getLogger("zoo")

RECORDS_PER_SHARD = 10_000


def convert_images(source: str, out: str, records_per_shard: int = RECORDS_PER_SHARD) -> int:
    """Write the image folder `source` into shards under `out`; the number of records."""
    root = Path(source).expanduser()
    if not root.is_dir():
        raise ZooError(f"{source} is not a directory: name an image folder (one folder per class).")
    if records_per_shard < 1:
        raise ZooError(f"--records-per-shard={records_per_shard} must be at least 1.")
    if (root / "train").is_dir() and (root / "val").is_dir():
        classes = class_names(root / "train")
        splits = {"train": root / "train", "val": root / "val"}
        targets = {"train": Path(out) / "train", "val": Path(out) / "val"}
    else:
        classes = class_names(root)
        splits, targets = {"all": root}, {"all": Path(out)}
    written = 0
    for split, folder in splits.items():
        paths, labels = scan(folder, classes, required=split != "val")
        kept = readable(Files(paths), OnError.skip, str(folder))
        items = [(paths[i], classes[labels[i]]) for i in kept]
        written += _write_shards(items, root, targets[split], records_per_shard)
    return written


def _write_shards(
    items: list[tuple[str, str]], root: Path, target: Path, records_per_shard: int
) -> int:
    target.mkdir(parents=True, exist_ok=True)
    count = max(math.ceil(len(items) / records_per_shard), 1)
    for shard in range(count):
        path = target / f"images-{shard:05d}-of-{count:05d}.array_record"
        partial = path.with_name(f".{path.name}.{os.getpid()}.part")
        writer = ArrayRecordWriter(str(partial), "group_size:1")
        for file, label in items[shard * records_per_shard : (shard + 1) * records_per_shard]:
            record = {
                "image": Path(file).read_bytes(),
                "label": label,
                "name": str(Path(file).relative_to(root)),
            }
            writer.write(msgpack.packb(record))
        writer.close()
        os.replace(partial, path)
    log.info("Wrote %d records into %d shard(s) in %s", len(items), count, target)
    return len(items)

"""Rewrites a workdir's earlier TensorBoard event files at a resume, for what TensorBoard reads
from the first file only.

TensorBoard keeps the first summary metadata it reads for each tag of a run. The HParams tab
reads a run's config from such metadata (`_hparams_/session_start_info`), so a run resumed with
other settings (more `trainer.steps`) would show the config of its first process forever. The
resumed process removes that entry from the files before its own: its own then comes first.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import struct

from tensorboardX.proto.event_pb2 import Event
from tensorboardX.record_writer import masked_crc32c

log = logging.getLogger("zoo")

SESSION_START_TAG = "_hparams_/session_start_info"
_HEADER = struct.Struct("<QI")  # a record: length, its CRC, the data, the data's CRC


def records(data: bytes) -> list[bytes]:
    """The whole records of an event file's bytes (a torn last record, from a kill, left out)."""
    found, at = [], 0
    while at + _HEADER.size <= len(data):
        length, _ = _HEADER.unpack_from(data, at)
        end = at + _HEADER.size + length + 4
        if end > len(data):
            break
        found.append(data[at + _HEADER.size : end - 4])
        at = end
    return found


def record(payload: bytes) -> bytes:
    header = struct.pack("<Q", len(payload))
    crc = struct.pack("<I", masked_crc32c(header))
    return header + crc + payload + struct.pack("<I", masked_crc32c(payload))


def drop_tag(workdir: str, tag: str = SESSION_START_TAG) -> None:
    """Rewrite each event file of `workdir` that holds `tag` without it (atomically: a new file
    renamed over the old). A file that cannot be rewritten (a full disk) stays as it is."""
    for path in sorted(glob.glob(os.path.join(workdir, "events.out.tfevents.*"))):
        try:
            _rewrite_without(path, tag)
        except OSError as e:
            log.warning("Could not rewrite %s (HParams may show the earlier config): %s", path, e)
            with contextlib.suppress(OSError):
                os.remove(path + ".tmp")


def _rewrite_without(path: str, tag: str) -> None:
    with open(path, "rb") as f:
        payloads = records(f.read())
    kept = [p for p in payloads if not holds_tag(p, tag)]
    if len(kept) < len(payloads):
        with open(path + ".tmp", "wb") as f:
            f.write(b"".join(record(p) for p in kept))
        os.replace(path + ".tmp", path)


def holds_tag(payload: bytes, tag: str) -> bool:
    event = Event.FromString(payload)
    return event.HasField("summary") and any(v.tag == tag for v in event.summary.value)

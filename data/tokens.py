"""Tokenized text kept on disk: a split's text encoded once into a file of int32 ids in the data
cache, then memory-mapped, so a corpus larger than memory trains and a rerun skips tokenizing.

The file's name is a hash of everything its ids depend on: each input file's path, size and
modification time, the tokenizer file's bytes, and which bytes of the files the split takes. A
changed file or tokenizer makes a new entry; the old one is never read again. An entry is
written to a temporary file and renamed into place, so a killed run leaves no partial entry.

The text is read and encoded a piece at a time, each piece ending at a line break followed by a
non-space character: the places where a tokenizer that splits text into words and runs of
whitespace (GPT-2's and its kind) starts a new word anyway, so the ids are those of the whole
text encoded at once, and memory holds one piece (about `PIECE` bytes) at a time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from zoo.data.files import CACHE_ENV, cache_root

from zoo.plugin import ZooError

PIECE = 1 << 20
"""Bytes read before a piece is cut and encoded."""

TOKEN = np.dtype("<i4")
FORMAT = "zoo-tokens-1"
"""Part of every entry's hash: a change to how entries are made changes this."""


@dataclasses.dataclass(frozen=True)
class Segment:
    """Bytes `start` to `end` of a file: a split's text is its segments, end to end."""

    file: Path
    start: int
    end: int


def tokenized(segments: Sequence[Segment], tokenizer_file: Path, tokenizer: Any) -> np.ndarray:
    """The ids of the segments' text (int32, memory-mapped read-only), from the cache, or
    encoded into it first."""
    target = cache_root() / "tokens" / f"{_key(segments, tokenizer_file)}.i32"
    if not target.is_file():
        _write(target, (_encode(piece, tokenizer) for piece in _pieces(_blocks(segments))))
    if target.stat().st_size == 0:
        return np.empty(0, TOKEN)
    return np.memmap(target, TOKEN, mode="r")


def _key(segments: Sequence[Segment], tokenizer_file: Path) -> str:
    digest = hashlib.sha256(FORMAT.encode())
    digest.update(hashlib.sha256(tokenizer_file.read_bytes()).digest())
    for segment in segments:
        info = segment.file.stat()
        described = f"{segment.file.resolve()}\0{info.st_size}\0{info.st_mtime_ns}"
        digest.update(f"{described}\0{segment.start}\0{segment.end}\n".encode())
    return digest.hexdigest()[:32]


def _blocks(segments: Sequence[Segment]) -> Iterator[bytes]:
    for segment in segments:
        with open(segment.file, "rb") as f:
            f.seek(segment.start)
            left = segment.end - segment.start
            while left > 0 and (block := f.read(min(PIECE, left))):
                left -= len(block)
                yield block


def _pieces(blocks: Iterator[bytes]) -> Iterator[bytes]:
    """The text in pieces that end where a new word starts on a new line."""
    pending = bytearray()
    for block in blocks:
        pending += block
        if len(pending) >= PIECE and (cut := _last_cut(pending)):
            yield bytes(pending[:cut])
            del pending[:cut]
    if pending:
        yield bytes(pending)


def _last_cut(text: bytearray) -> int:
    """Just after the last line break followed by a non-space character; 0 when none."""
    at = text.rfind(b"\n", 0, len(text) - 1)
    while at >= 0 and text[at + 1 : at + 2].isspace():
        at = text.rfind(b"\n", 0, at)
    return at + 1


def _encode(piece: bytes, tokenizer: Any) -> np.ndarray:
    text = piece.decode("utf-8", errors="replace")
    return np.asarray(tokenizer.encode(text, add_special_tokens=False).ids, TOKEN)


def _write(target: Path, chunks: Iterator[np.ndarray]) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=".", suffix=".part")
    except OSError as e:
        raise ZooError(
            f"Cannot write tokenized text to the data cache {target.parent} ({e.strerror}): set "
            f"{CACHE_ENV} to a writable directory."
        ) from None
    try:
        with os.fdopen(handle, "wb") as out:
            for chunk in chunks:
                out.write(chunk.tobytes())
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)

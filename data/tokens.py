"""Tokenized text kept on disk: a split's text encoded once into a file of int32 ids in the data
cache, then memory-mapped, so a corpus larger than memory trains and a rerun skips tokenizing;
and BPE tokenizers trained on a split's text (`data.tokenizer=bpe:N`), kept beside them.

The file's name is a hash of everything its ids depend on: each input file's path, size and
modification time, the tokenizer file's bytes (for a trained tokenizer: its size), and which
bytes of the files the split takes. A
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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from zoo.data.files import cache_root, write_atomically

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
    tokenizer_hash = hashlib.sha256(tokenizer_file.read_bytes()).digest()
    target = cache_root() / "tokens" / f"{_key(segments, tokenizer_hash)}.i32"
    if not target.is_file():
        pieces = _pieces(_blocks(segments))
        _write(target, (_encode(piece, tokenizer).tobytes() for piece in pieces))
    if target.stat().st_size == 0:
        return np.empty(0, TOKEN)
    return np.memmap(target, TOKEN, mode="r")


def trained_bpe(segments: Sequence[Segment], size: int) -> Path:
    """The `tokenizer.json` of a byte-level BPE tokenizer of `size` ids (fewer if the text
    holds fewer pairs to merge) trained on the segments' text, from the cache, or trained into
    it first. Training is deterministic: the same text and size give the same file, byte for
    byte. Its one special token, `END_OF_TEXT`, is id 0."""
    target = cache_root() / "tokenizers" / f"{_key(segments, f'bpe:{size}'.encode())}.json"
    if not target.is_file():
        _write(target, iter([_train_bpe(segments, size).to_str().encode()]))
    return target


END_OF_TEXT = "<|endoftext|>"


def _train_bpe(segments: Sequence[Segment], size: int) -> Any:
    """GPT-2's kind of tokenizer: text split into words and runs of whitespace, each word's
    UTF-8 bytes merged into tokens; every byte is a token, so any text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    pieces = _pieces(_blocks(segments))
    tokenizer.train_from_iterator((p.decode("utf-8", errors="replace") for p in pieces), trainer)
    return tokenizer


def _key(segments: Sequence[Segment], made_by: bytes) -> str:
    """The cache's name for what `made_by` (a tokenizer's hash, a training's settings) makes
    of the segments' text."""
    digest = hashlib.sha256(FORMAT.encode())
    digest.update(made_by)
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


def _write(target: Path, chunks: Iterator[bytes]) -> None:
    def write(out) -> None:
        for chunk in chunks:
            out.write(chunk)

    write_atomically(target, write)

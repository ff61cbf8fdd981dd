"""SigLIP's tokenizer (transformers' `SiglipTokenizer`) without sentencepiece: the checkpoint's
`spiece.model` read by a small protobuf reader and run as a `tokenizers` Unigram model, giving
the ids transformers gives.

SigLIP's checkpoints ship only the sentencepiece model (no `tokenizer.json`). Its pieces, scores
and normaliser (the precompiled character map of `nmt_nfkc`, where the model has one) are what
`tokenizers` needs: `Precompiled` normalisation, words split at spaces with `▁` before each
(`Metaspace`, as sentencepiece's dummy prefix and whitespace escaping do), then the Unigram
lattice. Before that each text is canonicalised as transformers does (`canonicalize_text`:
lowercased where `do_lower_case`, punctuation deleted, runs of whitespace one space, stripped);
after it, `</s>` is appended, and texts are padded with the pad token (`</s>`) to a fixed length
(`padding="max_length"`, as SigLIP's zero-shot pipeline asks: the text tower reads the last
position), longer ones truncated before their `</s>`.
"""

from __future__ import annotations

import dataclasses
import json
import re
import string
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, normalizers, pre_tokenizers
from tokenizers.models import Unigram

from zoo.plugin import ZooError

MODEL = "spiece.model"
CONFIG = "tokenizer_config.json"
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_NORMAL, _UNKNOWN = 1, 2  # sentencepiece's piece types


def _fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of a protobuf message: varints as ints, length-delimited fields
    as bytes, 32-bit fields as their 4 bytes (64-bit ones are not in sentencepiece's model)."""
    position = 0
    while position < len(data):
        key, position = _varint(data, position)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, position = _varint(data, position)
        elif wire == 2:
            size, position = _varint(data, position)
            value, position = data[position : position + size], position + size
        elif wire == 5:
            value, position = data[position : position + 4], position + 4
        else:
            raise ZooError(f"{MODEL}: protobuf wire type {wire} is not a sentencepiece model's.")
        yield number, value


def _varint(data: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[position]
        value |= (byte & 0x7F) << shift
        position, shift = position + 1, shift + 7
        if byte < 0x80:
            return value, position


@dataclasses.dataclass(frozen=True)
class SentencePieceModel:
    """What a `spiece.model` (`ModelProto`) holds that encoding needs: each piece's text,
    score and type, the unknown piece's id, byte fallback, the normaliser's character map."""

    pieces: list[tuple[str, float, int]]
    unk_id: int
    byte_fallback: bool
    charsmap: bytes

    @classmethod
    def read(cls, data: bytes) -> SentencePieceModel:
        pieces, trainer, normalizer = [], {}, {}
        for number, value in _fields(data):
            if number == 1:
                piece = dict(_fields(value))
                score = struct.unpack("<f", piece.get(2, b"\0\0\0\0"))[0]
                pieces.append((piece.get(1, b"").decode(), score, piece.get(3, _NORMAL)))
            elif number == 2:
                trainer = dict(_fields(value))
            elif number == 3:
                normalizer = dict(_fields(value))
        if trainer.get(3, 1) != 1:
            raise ZooError(
                f"{MODEL} has model_type={trainer[3]}: SigLIP's tokenizer is Unigram (1)."
            )
        unk = [i for i, (_, _, kind) in enumerate(pieces) if kind == _UNKNOWN]
        unk_id = unk[0] if unk else trainer.get(40, 0)
        return cls(pieces, unk_id, bool(trainer.get(35, 0)), normalizer.get(2, b""))

    def tokenizer(self) -> Tokenizer:
        """The `tokenizers` Unigram model of these pieces, sentencepiece's normaliser and
        word splitting before it."""
        vocab = [(piece, score) for piece, score, _ in self.pieces]
        tokenizer = Tokenizer(Unigram(vocab, self.unk_id, self.byte_fallback))
        if self.charsmap:
            tokenizer.normalizer = normalizers.Precompiled(self.charsmap)
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        return tokenizer


class SiglipTokenizer:
    """A SigLIP checkpoint's tokenizer: `tokenizer(texts)` gives (ids, mask), int32 texts x
    `length` (the `model_max_length` of `tokenizer_config.json`, 64 by default)."""

    def __init__(self, directory: str | Path) -> None:
        directory = Path(directory)
        if not (directory / MODEL).is_file():
            raise ZooError(f"{directory} has no {MODEL}: SigLIP's texts need its tokenizer.")
        model = SentencePieceModel.read((directory / MODEL).read_bytes())
        config_path = directory / CONFIG
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.tokenizer = model.tokenizer()
        self.lower = bool(config.get("do_lower_case", True))
        self.length = int(config.get("model_max_length", 64))
        ids = {piece: i for i, (piece, _, _) in enumerate(model.pieces)}
        self.eos_id = ids[_token(config, "eos_token", "</s>")]
        self.pad_id = ids[_token(config, "pad_token", "</s>")]

    def canonical(self, text: str) -> str:
        """`canonicalize_text`: lowercased, punctuation deleted, whitespace runs one space,
        stripped."""
        text = text.lower() if self.lower else text
        return re.sub(r"\s+", " ", text.translate(_PUNCTUATION)).strip()

    def encode(self, text: str) -> list[int]:
        """The ids of one text, without `</s>`. transformers canonicalises `"▁" + text`, so a
        text that begins with whitespace (once punctuation is gone) keeps a space after that
        `▁`, which becomes a `▁` piece of its own: that is reproduced (two leading spaces give
        `Metaspace` the same two `▁`)."""
        canonical = self.canonical("▁" + text.replace("▁", " "))[1:]
        lead = "  " if canonical.startswith(" ") else ""
        return self.tokenizer.encode(lead + canonical.strip(), add_special_tokens=False).ids

    def __call__(self, texts: Sequence[str], length: int | None = None) -> tuple[np.ndarray, ...]:
        """(ids, mask): each text's ids and `</s>`, padded with the pad token to `length`
        (default: the tokenizer's `model_max_length`), a longer one cut before its `</s>`;
        mask 1 on the text and its `</s>`."""
        length = length or self.length
        ids = np.full((len(texts), length), self.pad_id, np.int32)
        mask = np.zeros((len(texts), length), np.int32)
        for row, text in enumerate(texts):
            tokens = [*self.encode(text)[: length - 1], self.eos_id]
            ids[row, : len(tokens)], mask[row, : len(tokens)] = tokens, 1
        return ids, mask


def _token(config: dict, key: str, default: str) -> str:
    """A special token of `tokenizer_config.json`: a string, or an `AddedToken`'s dict."""
    value = config.get(key, default)
    return value.get("content", default) if isinstance(value, dict) else str(value)

"""Text as bytes, for byte-level language models: any text file or directory, by default the
Python standard library's own source files (present on every machine, nothing to download).
With `tokenizer` (a Hugging Face `tokenizer.json`, or a directory holding one), the text is
encoded into that tokenizer's ids instead (int32), for a model with its vocabulary (GPT-2's);
`tokenizer=bpe:N` trains a byte-level BPE tokenizer of N ids on the training split first (with
`tokenizers`, deterministically; cached beside the tokens, see `zoo.data.tokens`);
in `windows` mode those ids are cached on disk and memory-mapped (`zoo.data.tokens`), so a corpus
larger than memory trains.

Every split holds `tokens` (uint8 bytes or int32 ids, N x (L + 1)): a sequence whose first L
predict the last L, and `length` (int32, N): how many of those L targets are real text. Two
ways to cut it:

- `windows` (default): the text packed end to end and cut into windows of `window` + 1 bytes
  that overlap by one, so every byte after the first is predicted exactly once.
- `lines`: one example per line (with its newline), of varying length. A batch is padded to the
  smallest of a few fixed `buckets` lengths that holds its longest line, so a jitted step
  compiles once per bucket, never once per batch; `length` masks the padding out of the loss.

Held-out text: whole files, those whose name's CRC-32 is a multiple of 10, when that leaves
text on both sides; otherwise (one file, or an unlucky few) the last tenth of the text.
"""

from __future__ import annotations

import enum
import sysconfig
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from zoo.data.tokens import Segment, tokenized, trained_bpe

from zoo.plugin import Batch, Splits, ZooError, register_data

TOKENS, LENGTH = "tokens", "length"
TOKENIZER_FILE = "tokenizer.json"
BPE = "bpe:"
"""`data.tokenizer=bpe:N`: a BPE tokenizer of N ids trained on the training text."""
BYTES = 256
"""The ids a byte-level BPE tokenizer starts from, before its first merge."""


class TextMode(str, enum.Enum):
    windows = "windows"
    lines = "lines"


def stdlib_sources() -> list[Path]:
    """The default corpus: the standard library's top-level `*.py` files (4.7 MB on 3.11)."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def _text_files(path: str | None, pattern: str) -> list[Path]:
    if path is None:
        return stdlib_sources()
    root = Path(path).expanduser()
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise ZooError(
            f"data.path={path} does not exist: give a text file or a directory of text files "
            "(or leave data.path unset for the Python standard library's sources)."
        )
    return sorted(p for p in root.glob(pattern) if p.is_file())


def _text_segments(files: list[Path], where: str) -> list[Segment]:
    """The whole of each file that holds text: files with NUL bytes (binaries) are skipped."""
    texts = [Segment(f, 0, f.stat().st_size) for f in files if _is_text(f)]
    if not texts:
        raise ZooError(
            f"{where} holds no text: no non-empty file without NUL bytes among {len(files)} "
            "file(s). Point data.path at a text file or a directory of them (data.pattern "
            "chooses the files of a directory)."
        )
    return texts


def _is_text(file: Path) -> bool:
    with open(file, "rb") as f:
        blocks = iter(lambda: f.read(1 << 20), b"")
        first = next(blocks, b"")
        return bool(first) and b"\0" not in first and not any(b"\0" in b for b in blocks)


def _train_and_held_out(path: str | None, pattern: str) -> tuple[list[Segment], list[Segment]]:
    """The text of the files `path` and `pattern` name, split into training and held-out text."""
    where = "The Python standard library" if path is None else f"data.path={path}"
    return _split(_text_segments(_text_files(path, pattern), where))


def _split(texts: list[Segment]) -> tuple[list[Segment], list[Segment]]:
    held_out = [zlib.crc32(t.file.name.encode()) % 10 == 0 for t in texts]
    if any(held_out) and not all(held_out):
        train = [t for t, out in zip(texts, held_out, strict=True) if not out]
        return train, [t for t, out in zip(texts, held_out, strict=True) if out]
    total = sum(t.end for t in texts)
    cut = total - total // 10
    return _slice(texts, 0, cut), _slice(texts, cut, total)


def _slice(texts: list[Segment], start: int, stop: int) -> list[Segment]:
    """Bytes `start` to `stop` (`stop` None: to the end) of the segments' text, end to end."""
    sliced, offset = [], 0
    for t in texts:
        size = t.end - t.start
        begin, end = max(start - offset, 0), size if stop is None else min(stop - offset, size)
        if begin < end:
            sliced.append(Segment(t.file, t.start + begin, t.start + end))
        offset += size
    return sliced


def _read(segments: list[Segment]) -> bytes:
    return b"".join(_read_segment(s) for s in segments)


def _read_segment(segment: Segment) -> bytes:
    with open(segment.file, "rb") as f:
        f.seek(segment.start)
        return f.read(segment.end - segment.start)


def bpe_size(tokenizer: str | None) -> int | None:
    """N of a `bpe:N` tokenizer setting; None for a file, a directory or bytes."""
    if tokenizer is None or not str(tokenizer).startswith(BPE):
        return None
    size = str(tokenizer)[len(BPE) :]
    if not size.isdigit() or int(size) <= BYTES:
        raise ZooError(
            f"data.tokenizer={tokenizer}: a trained BPE tokenizer takes its number of ids, more "
            f"than the {BYTES} bytes it starts from plus its end-of-text token, e.g. "
            f"data.tokenizer={BPE}4096."
        )
    return int(size)


def trained_tokenizer(
    path: str | None = None, pattern: str = "**/*", tokenizer: str | None = None, **_: Any
) -> Path | None:
    """The `tokenizer.json` that a `text` config's `tokenizer` names: the file (or the one in
    a directory), or for `bpe:N` the one trained on its training split (cached: trained on
    first use); None for bytes. Takes the data set's config as keywords."""
    if bpe_size(tokenizer) is None:
        return None if tokenizer is None else tokenizer_file(tokenizer)
    train, _ = _train_and_held_out(path, pattern)
    return _tokenizer_for(tokenizer, train)


def _tokenizer_for(tokenizer: str | None, train: list[Segment]) -> Path | None:
    """The `tokenizer.json` of a `tokenizer` setting, one trained on `train` for `bpe:N`."""
    if tokenizer is None:
        return None
    size = bpe_size(tokenizer)
    return tokenizer_file(tokenizer) if size is None else trained_bpe(train, size)


def tokenizer_file(path: str | Path) -> Path:
    """The `tokenizer.json` that `path` names: the file, or the one in a directory."""
    file = Path(path).expanduser()
    file = file / TOKENIZER_FILE if file.is_dir() else file
    if not file.is_file():
        raise ZooError(
            f"data.tokenizer={path} is not a tokenizer: give a Hugging Face {TOKENIZER_FILE} "
            "file or a directory holding one (unset: byte-level text)."
        )
    return file


def load_tokenizer(path: str | Path) -> Any:
    """The `tokenizers.Tokenizer` of a `tokenizer.json` file, or of the one in a directory."""
    from tokenizers import Tokenizer

    file = tokenizer_file(path)
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # noqa: BLE001  (the library raises a bare Exception)
        raise ZooError(f"Cannot read the tokenizer {file}: {e}.") from None


def encode(text: bytes, tokenizer: Any | None) -> np.ndarray:
    """The model's tokens for `text`: its bytes (uint8), or the tokenizer's ids (int32)."""
    if tokenizer is None:
        return np.frombuffer(text, np.uint8)
    ids = tokenizer.encode(text.decode("utf-8", errors="replace"), add_special_tokens=False).ids
    return np.asarray(ids, np.int32)


def _windows(data: np.ndarray, window: int, what: str) -> dict[str, np.ndarray]:
    if len(data) < window + 1:
        raise ZooError(
            f"The {what} text has {len(data)} tokens, fewer than one window of data.window="
            f"{window} + 1: use more text or a smaller data.window."
        )
    tokens = sliding_window_view(data, window + 1)[::window]
    return {TOKENS: tokens, LENGTH: np.full(len(tokens), window, np.int32)}


def _lines(stream: bytes, longest: int, what: str, tokenizer: Any) -> dict[str, np.ndarray]:
    """One row per line with something to predict, truncated to `longest` targets."""
    encoded = (encode(line, tokenizer) for line in stream.splitlines(keepends=True))
    lines = [line[: longest + 1] for line in encoded if len(line) > 1]
    if not lines:
        raise ZooError(f"The {what} text has no line of two or more tokens.")
    tokens = np.zeros((len(lines), longest + 1), lines[0].dtype)
    for row, line in zip(tokens, lines, strict=True):
        row[: len(line)] = line
    return {TOKENS: tokens, LENGTH: np.array([len(line) - 1 for line in lines], np.int32)}


class BucketPadding:
    """Batch transform of `lines` mode: crop the padded rows to the smallest bucket length
    that holds the batch's longest line, so batches come in a few fixed shapes."""

    def __init__(self, buckets: list[int]):
        self.buckets = sorted(buckets)

    def __call__(self, batch: Batch) -> Batch:
        longest = int(batch[LENGTH].max())
        bucket = next(b for b in self.buckets if b >= longest)
        return {TOKENS: batch[TOKENS][:, : bucket + 1]}


@register_data("text")
def text(
    # A text file or a directory; null: the Python standard library's sources.
    path: str | None = None,
    pattern: str = "**/*",  # glob of the files of a directory `path` that are read (`**/*`: all)
    # `windows`: the text packed end to end, cut into windows; `lines`: one example per line, each
    # batch padded to a bucket.
    mode: TextMode = TextMode.windows,
    # Tokens (bytes, or a tokenizer's ids) that each window predicts, in `windows` mode; a window
    # holds one more.
    window: int = 128,
    # Lengths that `lines` mode pads a batch to (the smallest that holds its longest line); longer
    # lines are cut to the largest.
    buckets: list[int] = [32, 64, 128, 256],  # noqa: B006  (a config default, never mutated)
    # Bytes of held-out text evaluated (0: all of it), to keep an eval short.
    eval_bytes: int = 262_144,
    # A Hugging Face `tokenizer.json`, or a directory holding one, whose ids replace the bytes;
    # `bpe:N`: a byte-level BPE tokenizer of N ids trained on the training text (cached); null:
    # bytes.
    tokenizer: str | None = None,
) -> Splits:
    """Bytes of text for a byte-level language model. `path`: a text file or a directory
    (its files matching `pattern`); unset: the Python standard library's sources. `eval_bytes`
    caps the held-out text (0: all of it), which keeps an eval to seconds. `tokenizer`: a
    `tokenizer.json` (or a directory with one) whose ids replace the bytes, or `bpe:N`, one of
    N ids trained on the training split (never on the held-out text)."""
    if window < 1 or eval_bytes < 0:
        raise ZooError(
            f"data.window={window} must be at least 1 and data.eval_bytes={eval_bytes} at "
            "least 0 (0: all the held-out text)."
        )
    if not buckets or min(buckets) < 1:
        raise ZooError(f"data.buckets={list(buckets)} must be one or more positive lengths.")
    train, test = _train_and_held_out(path, pattern)
    test = _slice(test, 0, eval_bytes or None)
    file = _tokenizer_for(tokenizer, train)
    encoder = None if file is None else load_tokenizer(file)
    if mode == TextMode.lines:
        longest = max(buckets)
        return Splits(
            train=_lines(_read(train), longest, "training", encoder),
            eval=_lines(_read(test), longest, "held-out", encoder),
            transform=BucketPadding(list(buckets)),
            tokenizer=encoder,
        )
    if encoder is None:
        train_tokens, test_tokens = encode(_read(train), None), encode(_read(test), None)
    else:
        train_tokens = tokenized(train, file, encoder)
        test_tokens = tokenized(test, file, encoder)
    return Splits(
        train=_windows(train_tokens, window, "training"),
        eval=_windows(test_tokens, window, "held-out"),
        tokenizer=encoder,
    )

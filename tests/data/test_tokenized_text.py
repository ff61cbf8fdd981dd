"""`data=text data.tokenizer=...`: the text tokenized once into a cached int32 file, memory-mapped;
the ids are the tokenizer's for the whole text though it is encoded a piece at a time; a changed
file or tokenizer makes a new entry, an unchanged one is reused; a gpt trains from it."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT
from zoo.data import tokens as token_cache
from zoo.data.text import load_tokenizer
from zoo.data.tokens import Segment, tokenized

import zoo

TINY = ROOT / "tests" / "fixtures" / "pretrained" / "gpt2-tiny"
TOKENIZER = load_tokenizer(TINY)
STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A folder of three source files (indentation, blank lines, unicode), and its own cache."""
    folder = tmp_path_factory.mktemp("corpus")
    for name in ("textwrap.py", "shlex.py", "colorsys.py"):
        shutil.copy(STDLIB / name, folder / name)
    (folder / "zzz.txt").write_text("naïve café — ünïcödé\n\n  indented\n\tTabbed\nend\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ZOO_DATA_DIR", str(tmp_path_factory.mktemp("cache")))
        yield folder


def entries() -> dict[str, int]:
    """Cache entry -> its modification time."""
    return {p.name: p.stat().st_mtime_ns for p in (token_cache.cache_root() / "tokens").glob("*")}


def untokenized(split: dict[str, np.ndarray]) -> np.ndarray:
    """The token stream that overlapping windows were cut from."""
    tokens = split["tokens"]
    return np.concatenate([tokens[:, :-1].ravel(), tokens[-1, -1:]])


def test_pieces_encode_to_the_ids_of_the_whole_text(corpus, monkeypatch):
    monkeypatch.setattr(token_cache, "PIECE", 256)  # many pieces, cut at many line breaks
    files = sorted(corpus.iterdir())
    segments = [Segment(f, 0, f.stat().st_size) for f in files]
    ids = tokenized(segments, TINY / "tokenizer.json", TOKENIZER)
    whole = b"".join(f.read_bytes() for f in files).decode()
    assert isinstance(ids, np.memmap) and ids.dtype == np.int32
    np.testing.assert_array_equal(ids, TOKENIZER.encode(whole, add_special_tokens=False).ids)


def test_the_data_set_is_the_cached_ids_made_once_and_reused(corpus, monkeypatch):
    before = entries()
    splits = zoo.load_data("text", path=str(corpus), tokenizer=str(TINY), window=32)
    made = entries()
    assert len(made) == len(before) + 2  # training and held-out text
    files = sorted(corpus.iterdir())  # zzz.txt held out: its name's CRC-32 is a multiple of 10
    train = b"".join(f.read_bytes() for f in files if f.name != "zzz.txt").decode()
    expected = TOKENIZER.encode(train, add_special_tokens=False).ids
    stream = untokenized(splits.train)
    assert 0 <= len(expected) - len(stream) < 32  # the last partial window dropped
    np.testing.assert_array_equal(stream, expected[: len(stream)])
    assert splits.train["tokens"].dtype == np.int32

    def never(*args):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(token_cache, "_encode", never)
    again = zoo.load_data("text", path=str(corpus), tokenizer=str(TINY), window=32)
    np.testing.assert_array_equal(again.train["tokens"], splits.train["tokens"])
    np.testing.assert_array_equal(again.eval["tokens"], splits.eval["tokens"])
    assert entries() == made


def test_a_changed_file_or_tokenizer_makes_a_new_entry(corpus, tmp_path):
    zoo.load_data("text", path=str(corpus), tokenizer=str(TINY), window=32)
    before = entries()
    changed = tmp_path / "changed"
    shutil.copytree(corpus, changed)
    zoo.load_data("text", path=str(changed), tokenizer=str(TINY), window=32)
    copied = entries()
    (changed / "shlex.py").write_text((changed / "shlex.py").read_text() + "\n# more\n")
    zoo.load_data("text", path=str(changed), tokenizer=str(TINY), window=32)
    edited = entries()
    assert len(edited) == len(copied) + 1 and before.items() <= edited.items()

    other = tmp_path / "tokenizer.json"  # the same tokenizer, written differently
    other.write_text(json.dumps(json.loads((TINY / "tokenizer.json").read_text()), indent=1))
    zoo.load_data("text", path=str(changed), tokenizer=str(other), window=32)
    assert len(entries()) == len(edited) + 2


def test_a_gpt_trains_from_the_cached_ids(corpus, tmp_path):
    result = zoo.fit(
        "gpt",
        "data=text",
        f"data.path={corpus}",
        f"data.tokenizer={TINY}",
        "data.window=16",
        "model.vocab_size=300",
        "model.dim=32",
        "model.depth=1",
        "model.context_length=16",
        "trainer.steps=3",
        "trainer.batch_size=8",
        "optimizer.warmup_steps=0",
        f"workdir={tmp_path / 'run'}",
    )
    assert result.step == 3
    assert np.isfinite(result.eval_metrics["bits_per_token"])

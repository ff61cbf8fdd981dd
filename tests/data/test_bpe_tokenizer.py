"""`data.tokenizer=bpe:N`: a byte-level BPE tokenizer trained by `tokenizers` on the text data's
training split alone, deterministically (the same text, the same file byte for byte), cached
beside the token cache; the model's vocabulary set from it when the user leaves it; a run keeps
it in its workdir, where generation, export and a fine-tune find it after the cache is gone."""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest
from helpers import ROOT, run_cli
from zoo.data.text import load_tokenizer, trained_tokenizer

import zoo

TEXT = ROOT / "tests" / "fixtures" / "pretrained" / "tiny.txt"
TRAIN_WORD, HELD_OUT_WORD = "alphabetical", "zyzzyva"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two files: zzz.txt is held out (its name's CRC-32 is a multiple of 10)."""
    folder = tmp_path_factory.mktemp("bpe-corpus")
    (folder / "a.txt").write_text(f"{TRAIN_WORD} order\n" * 300 + TEXT.read_text())
    (folder / "zzz.txt").write_text(f"{HELD_OUT_WORD} {HELD_OUT_WORD}\n" * 300)
    return folder


def test_trained_on_the_training_split_deterministically_and_cached(corpus, tmp_path, monkeypatch):
    files = []
    for cache in ("first", "second"):
        monkeypatch.setenv("ZOO_DATA_DIR", str(tmp_path / cache))
        files.append(trained_tokenizer(path=str(corpus), tokenizer="bpe:400"))
    first, second = files
    assert first.parent == tmp_path / "first" / "tokenizers"
    assert first.read_bytes() == second.read_bytes()
    made = second.stat().st_mtime_ns
    assert trained_tokenizer(path=str(corpus), tokenizer="bpe:400") == second  # from the cache
    assert second.stat().st_mtime_ns == made
    tokenizer = load_tokenizer(second)
    assert tokenizer.get_vocab_size() == 400
    assert tokenizer.encode(TRAIN_WORD).tokens == [TRAIN_WORD]  # learnt
    assert not any("zyzz" in token for token in tokenizer.get_vocab())  # never seen
    held_out = tokenizer.encode(HELD_OUT_WORD).ids
    assert len(held_out) > 1 and tokenizer.decode(held_out) == HELD_OUT_WORD  # still encodes


def test_the_text_data_set_reads_its_ids(corpus):
    splits = zoo.load_data("text", path=str(corpus), tokenizer="bpe:400", window=16)
    assert splits.tokenizer.get_vocab_size() == 400
    for split in (splits.train, splits.eval):
        assert split["tokens"].dtype == np.int32 and split["tokens"].max() < 400
    first = splits.train["tokens"][0].tolist()
    assert splits.tokenizer.decode(first).startswith(f"{TRAIN_WORD} order\n{TRAIN_WORD}")


@pytest.mark.parametrize("setting", ["bpe:256", "bpe:many", "bpe:"])
def test_a_size_it_cannot_train_is_refused_by_name(corpus, setting):
    with pytest.raises(zoo.ZooError, match=f"^data.tokenizer={setting}: a trained BPE"):
        zoo.load_data("text", path=str(corpus), tokenizer=setting)


def test_the_model_takes_its_vocabulary_unless_the_user_set_one(corpus, caplog):
    with caplog.at_level(logging.INFO, logger="zoo"):
        cfg = zoo.compose(["model=gpt", f"data.path={corpus}", "data.tokenizer=bpe:400"])
    assert cfg.data.tokenizer == str(trained_tokenizer(path=str(corpus), tokenizer="bpe:400"))
    assert cfg.model.vocab_size == 400
    assert any(r.getMessage().startswith("model.vocab_size=400: ") for r in caplog.records)
    larger = zoo.compose(
        ["model=gpt", f"data.path={corpus}", "data.tokenizer=bpe:400", "model.vocab_size=512"]
    )
    assert larger.model.vocab_size == 512
    with pytest.raises(zoo.ZooError, match="has 400 ids, more than .* model.vocab_size=300"):
        zoo.compose(
            ["model=gpt", f"data.path={corpus}", "data.tokenizer=bpe:400", "model.vocab_size=300"]
        )


def test_a_cli_run_keeps_its_tokenizer_for_generation(tmp_path):
    cache, workdir = tmp_path / "cache", tmp_path / "run"
    result = run_cli(
        "model=gpt",
        *zoo.engine.registry.get_model("gpt").tiny,
        f"data.path={TEXT}",
        "data.tokenizer=bpe:300",
        "trainer.steps=2",
        "trainer.batch_size=8",
        f"workdir={workdir}",
        env={"ZOO_DATA_DIR": str(cache)},
    )
    assert result.returncode == 0, result.stderr
    assert "model.vocab_size=300: the ids of the tokenizer data.tokenizer=bpe:300" in result.stderr
    (trained,) = (cache / "tokenizers").iterdir()
    kept = workdir / "tokenizer.json"
    assert load_tokenizer(kept).to_str() == load_tokenizer(trained).to_str()
    shutil.rmtree(cache)  # generation and export read the run's own copy
    text = zoo.generate(workdir, "def ", max_new_tokens=6, temperature=0)
    loaded = zoo.load(workdir)
    assert text == zoo.generate(loaded, "def ", max_new_tokens=6, temperature=0, tokenizer=kept)
    assert loaded.model.vocab_size == 300
    exported = zoo.export(workdir, tmp_path / "hf")
    assert load_tokenizer(exported).to_str() == load_tokenizer(kept).to_str()
    tuned = zoo.finetune(workdir, "trainer.steps=3", f"workdir={tmp_path / 'tuned'}")
    assert tuned.config.data.tokenizer == str(kept)  # the ids the run read

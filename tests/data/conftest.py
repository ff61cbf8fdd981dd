"""What the tests of the chat data sets (`chat`, `preference`, `prompts`) share."""

from __future__ import annotations

import pytest
from helpers import ROOT
from zoo.data.chat_tokens import Encoder
from zoo.data.text import load_tokenizer

QWEN25_CHAT = ROOT / "tests" / "fixtures" / "pretrained" / "qwen25-chat"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A data cache of the test's own: what a loader caches is made afresh."""
    monkeypatch.setenv("ZOO_DATA_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    """Qwen 2.5's chat template and tokenizer, a reply's tokens carrying loss."""
    return Encoder.load(QWEN25_CHAT, load_tokenizer(QWEN25_CHAT), "completion")

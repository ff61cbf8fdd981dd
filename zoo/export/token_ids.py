"""The special token ids a language model's exported `config.json` names.

transformers' GPT-2 config defaults `bos_token_id` and `eos_token_id` to 50256 (GPT-2's
`<|endoftext|>`) when they are absent, which is wrong for any other vocabulary, so the export
always writes them: the end-of-text token of the tokenizer exported beside the weights, else
GPT-2's 50256 for a vocabulary that holds it, else None (a byte-level model has no such token).
"""

from __future__ import annotations

import json
from typing import Any

GPT2_END_OF_TEXT = 50256
END_OF_TEXT = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


def special_token_ids(tokenizer: str | None, vocab_size: int) -> dict[str, Any]:
    """`bos_token_id` and `eos_token_id` (GPT-2 uses its end-of-text token for both) for a
    model of `vocab_size` tokens and its `tokenizer.json` (None: none)."""
    token = _tokenizer_end_of_text(tokenizer) if tokenizer else None
    if token is None and not tokenizer and vocab_size > GPT2_END_OF_TEXT:
        token = GPT2_END_OF_TEXT
    if token is not None and token >= vocab_size:
        token = None
    return {"bos_token_id": token, "eos_token_id": token}


def _tokenizer_end_of_text(path: str) -> int | None:
    """The id of the tokenizer's end-of-text token: its special token of a known name, else
    its only special token."""
    with open(path, encoding="utf-8") as f:
        added = json.load(f).get("added_tokens") or []
    special = {token["content"]: int(token["id"]) for token in added if token.get("special")}
    named = [special[name] for name in END_OF_TEXT if name in special]
    if named:
        return named[0]
    return next(iter(special.values())) if len(special) == 1 else None

"""The `hf` format of `zoo.export` (what it writes: `zoo.exporting`): the checkpoint family
whose layout a run is written in (`export_family`), the files the run carries beside its
weights (`carried_files`), and the end-of-text token a language model's config names
(`special_token_ids`).

transformers' GPT-2 config defaults `bos_token_id` and `eos_token_id` to 50256 (GPT-2's
`<|endoftext|>`) when they are absent, which is wrong for any other vocabulary, so the export
always writes them: the end-of-text token of the tokenizer exported beside the weights, else
GPT-2's 50256 for a vocabulary that holds it, else None (a byte-level model has no such token).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any

from zoo.engine import registry
from zoo.engine import weights as pretrained
from zoo.engine.errors import ZooError
from zoo.pretrained import run_tokenizer
from zoo.trained import TrainedModel, resolved_hparams

log = logging.getLogger("zoo")
CARRIED = (
    pretrained.TOKENIZER,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "merges.txt",
)
"""The files of a pretrained directory that a run from it carries into its export: the
tokenizer (SigLIP's sentencepiece model, `spiece.model`, too) and its settings, the chat template and the generation config."""
GPT2_END_OF_TEXT = 50256
END_OF_TEXT = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


def write_hf(trained: TrainedModel, out: str, **writing: Any) -> str:
    """Write `trained` into `out` in its family's layout; `writing`: `dtype` and
    `max_shard_size`, as `zoo.export` takes them."""
    family, hparams = export_family(trained), resolved_hparams(trained.config)
    if hasattr(trained.model, "hold_positions_at_input_size"):
        with trained.activate():
            hparams["position_grid"] = list(trained.model.hold_positions_at_input_size())
    tensors = pretrained.export_tensors(trained.model, family, hparams)
    config = family.export_config(hparams)
    carried = carried_files(trained.config, trained.workdir)
    if "vocab_size" in config:
        config.update(special_token_ids(carried.get(pretrained.TOKENIZER), config["vocab_size"]))
    pretrained.write_pretrained(out, config, tensors, sidecars=family.sidecars, **writing)
    for name, path in carried.items():
        shutil.copyfile(path, os.path.join(out, name))
    return out


def export_family(trained: TrainedModel) -> registry.Family:
    """The checkpoint family whose layout `trained` is written in, or a `ZooError` saying why
    none holds it (use `format=jax`)."""
    name, start = trained.config.model.name, trained.config.finetune.init_from
    if start and pretrained.is_pretrained(start):
        return pretrained.open_pretrained(start, name).family
    found = [f for f in registry.families(name) if f.export_config is not None]
    if not found:
        raise ZooError(
            f"Model '{name}' loads no checkpoint family with an export layout, so format=hf "
            "has no layout to write; use format=jax."
        )
    hparams, refusals = resolved_hparams(trained.config), []
    for family in found:  # the first whose layout holds this model's settings
        try:
            family.export_config(hparams)
        except ZooError as e:
            refusals.append(f"{family.name}: {e}")
            continue
        return family
    raise ZooError(
        f"No checkpoint family of model '{name}' has a layout that holds this model's "
        f"settings, so format=hf cannot write it; use format=jax. {' '.join(refusals)}"
    )


def carried_files(config: Any, workdir: str | None = None) -> dict[str, str]:
    """File name -> path of what an export of the run of `config` carries beside the weights:
    the tokenizer it trained with (`data.tokenizer`, or where that is gone the copy the run
    kept in its `workdir`) and what the pretrained directory it started from holds of
    `CARRIED`; only the former where the two tokenizers differ (the directory's settings are
    its own tokenizer's)."""
    start = config.finetune.get("init_from")
    source = start if start and pretrained.is_pretrained(start) else None
    if start and not os.path.exists(start):
        log.warning(
            "The run started from %s, which is gone: the export carries no tokenizer settings, "
            "chat template or generation config of it.",
            start,
        )
    found = {
        name: os.path.join(source, name)
        for name in (CARRIED if source else ())
        if os.path.isfile(os.path.join(source, name))
    }
    tokenizer = run_tokenizer(config, workdir)
    if not tokenizer:
        return found
    own = found.get(pretrained.TOKENIZER)
    if own is None or not os.path.samefile(own, tokenizer):
        return {pretrained.TOKENIZER: tokenizer}
    return found


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

"""A pretrained checkpoint directory where a zoo workdir goes: what a run starting from one needs.

`finetune.init_from=DIR` on a pretrained directory (see `zoo.engine.weights.pretrained`) makes the model what
the checkpoint's `config.json` implies (its sizes, vocabulary, options: `model.*` keys the
command line did not set itself), except what the run's data set decides (an image data set's
`input_shape` and `num_classes`: the model adapts the checkpoint to them, e.g. ViT positions
resized, a 1-channel stem summed, a head named in `finetune.reinit` started fresh), and gives a
text data set the directory's `tokenizer.json` unless `data.tokenizer` is set. A tokenizer with
more ids than the model's vocabulary is an error before anything is built. Its model normalises
pixels itself, with the checkpoint's statistics, so an image data set's own normalisation is
turned off (see `zoo.defaults`, which fits zoo's defaults to the model the checkpoint makes).
The directory may be named by its Hugging Face Hub name (`hf://ORG/NAME`, see `zoo.hub`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from omegaconf import DictConfig

from zoo.engine import registry, weights
from zoo.hub import local

INIT_FROM = "finetune.init_from="


def pretrained_args(overrides: Sequence[str]) -> list[str]:
    """The overrides a run from the pretrained directory that `overrides` name implies, less
    those `overrides` set themselves and, when they name a data set, those it decides (its
    input shape, its classes); [] when `finetune.init_from` is not one. An `hf://` name there
    is replaced by the directory it resolves to (`zoo.hub`): the engine reads directories."""
    starts = [o[len(INIT_FROM) :] for o in overrides if o.startswith(INIT_FROM)]
    if not starts:
        return []
    start = local(starts[-1])
    resolved = [] if start == starts[-1] else [f"{INIT_FROM}{start}"]
    if not weights.is_pretrained(start):
        return resolved
    models = [o.partition("=")[2] for o in overrides if o.startswith("model=")]
    pretrained = weights.open_pretrained(start, models[-1] if models else None)
    given = {o.split("=")[0].lstrip("+~") for o in overrides}
    data = [o.partition("=")[2] for o in overrides if o.startswith("data=")]
    entry = registry.get_model(pretrained.family.model)
    data_entry = registry.get_data(data[-1] if data else entry.default_data)
    args = resolved + ([] if models else [f"model={pretrained.family.model}"])
    args += [
        f"model.{key}={json.dumps(value)}"
        for key, value in pretrained.hparams().items()
        if f"model.{key}" not in given and not (data and key in data_entry.decides)
    ]
    takes_tokenizer = "tokenizer" in _fields(data_entry)
    if pretrained.tokenizer and takes_tokenizer and "data.tokenizer" not in given:
        args.append(f"data.tokenizer={pretrained.tokenizer}")
    return args


def is_pretrained_dir(path: str | os.PathLike) -> bool:
    """Whether `path` is a pretrained checkpoint directory rather than a run's workdir (an
    exported run may hold both: its checkpoints win)."""
    return weights.is_pretrained(path) and not os.path.isdir(os.path.join(path, "checkpoints"))


def run_tokenizer(config: DictConfig, workdir: str | os.PathLike | None) -> str | None:
    """The `tokenizer.json` a run's model speaks: the file its `data.tokenizer` names (the one
    in a directory), or, where that is gone (a data cache cleared, a run copied to another
    machine), the copy the run kept in its `workdir`; None for a byte-level run."""
    setting = config.data.get("tokenizer")
    if not setting:
        return None
    named = os.path.join(setting, weights.TOKENIZER) if os.path.isdir(setting) else setting
    kept = os.path.join(workdir, weights.TOKENIZER) if workdir is not None else None
    return kept if not os.path.isfile(named) and kept and os.path.isfile(kept) else named


def _fields(entry: registry.DataEntry) -> set[str]:
    return {name for name in getattr(entry.config, "__dataclass_fields__", {})}


def list_models(families: bool = False) -> list[str] | dict[str, list[str]]:
    """Names of the registered models, sorted; with `families`, each name -> the checkpoint
    families it loads (one line each, e.g. "gpt2: GPT-2, transformers GPT2LMHeadModel"; [] for
    a model that loads none), from the registry, so a family registered later shows too."""
    names = registry.list_models()
    if not families:
        return names
    return {name: [_line(f) for f in registry.families(name)] for name in names}


def families_help() -> str:
    """The `--help` lines on which model loads which checkpoint families."""
    loads = {name: found for name, found in list_models(families=True).items() if found}
    if not loads:
        return "  (no model loads checkpoints of other libraries)\n"
    return "".join(f"  {name}: {line}\n" for name, found in loads.items() for line in found)


def _line(family: registry.Family) -> str:
    return f"{family.name}: {family.description}" if family.description else family.name

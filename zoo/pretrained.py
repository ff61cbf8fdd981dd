"""A pretrained checkpoint directory where a zoo workdir goes: what a run starting from one needs.

`finetune.init_from=DIR` on a pretrained directory (see `zoo.engine.weights`) makes the model what
the checkpoint's `config.json` implies (its sizes, vocabulary, options: `model.*` keys the
command line did not set itself), except what the run's data set decides (an image data set's
`input_shape` and `num_classes`: the model adapts the checkpoint to them, e.g. ViT positions
resized, a 1-channel stem summed, a head named in `finetune.reinit` started fresh), and gives a
text data set the directory's `tokenizer.json` unless `data.tokenizer` is set. A tokenizer with
more ids than the model's vocabulary is an error before anything is built. Its model normalises
pixels itself, with the checkpoint's statistics, so an image data set's own normalisation is
turned off. A text data set's default lengths are fitted to the model's context (`fit_context`),
and the model's default vocabulary to the data's tokenizer (`fit_tokenizer`), each said in one
line. The directory may be named by its Hugging Face Hub name (`hf://ORG/NAME`, see `zoo.hub`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence

from omegaconf import DictConfig, OmegaConf

from zoo.data.text import bpe_size, load_tokenizer, trained_tokenizer
from zoo.engine import registry, weights
from zoo.engine.errors import ZooError
from zoo.hub import local

INIT_FROM = "finetune.init_from="

log = logging.getLogger("zoo")


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
    given = _keys(overrides)
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


def fit_normalisation(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """A model that normalises its inputs itself (`model.pixel_mean` and `pixel_std`, as a
    pretrained directory sets them) reads its data set's pixels in [0, 1]: the data set's own
    normalisation is turned off (said in one line), and one the overrides turn on is refused,
    since the pixels would be normalised twice."""
    if cfg.model.get("pixel_mean") is None or "normalize" not in cfg.data:
        return
    setting = cfg.data.normalize
    off = False if isinstance(setting, bool) else "none"
    if setting == off:
        return
    if "data.normalize" in _keys(overrides):
        raise ZooError(
            f"data.normalize={_shown(setting)} would normalise the pixels twice: model "
            f"'{cfg.model.name}' normalises its inputs itself (model.pixel_mean="
            f"{list(cfg.model.pixel_mean)}, model.pixel_std={list(cfg.model.pixel_std)}, what "
            f"its weights expect) and takes pixels in [0, 1]: set data.normalize={_shown(off)} "
            "or leave it out."
        )
    cfg.data.normalize = off
    log.info(
        "data.normalize=%s: model '%s' normalises its inputs itself (model.pixel_mean), so "
        "data set '%s' gives it pixels in [0, 1].",
        _shown(off),
        cfg.model.name,
        cfg.data.name,
    )


def fit_context(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """A model with fewer positions (`model.context_length`, a checkpoint's `n_positions`)
    than a text data set's default lengths would be refused at its first batch: zoo's defaults
    are fitted to it instead, each said in one line. `windows` mode cuts windows of the
    context's length (`data.window`); `lines` mode keeps the buckets shorter than the context
    and adds the context itself (`data.buckets`). A length the overrides set that is longer
    than the context is a `ZooError`, before anything is built."""
    context, data = cfg.model.get("context_length"), cfg.data
    if context is None:
        return
    given, lines = _keys(overrides), _shown(data.get("mode")) == "lines"
    window = data.get("window")
    if window is not None and not lines and window > context:
        _refuse_given("data.window", window, window, cfg, given)
        data.window = context
        _said_fitted("data.window", cfg, f"windows of {window} tokens", f"windows of {context}")
    buckets = list(data.get("buckets") or [])
    if buckets and lines and max(buckets) > context:
        _refuse_given("data.buckets", buckets, max(buckets), cfg, given)
        data.buckets = sorted({b for b in buckets if b < context} | {context})
        _said_fitted("data.buckets", cfg, f"buckets {buckets}", f"buckets {list(data.buckets)}")


def _refuse_given(key: str, value: object, length: int, cfg: DictConfig, given: set[str]) -> None:
    """A `ZooError` when the overrides set `key`, whose `value` makes sequences of `length`."""
    if key in given:
        context = cfg.model.context_length
        raise ZooError(
            f"{key}={value} would give model '{cfg.model.name}' sequences of {length} tokens, "
            f"more than model.context_length={context}, the positions it has: use a {key} of "
            f"at most {context}, or leave {key} out to have it fitted."
        )


def _said_fitted(key: str, cfg: DictConfig, default: str, fitted: str) -> None:
    log.info(
        "%s: model '%s' has model.context_length=%d positions, fewer than data set '%s' takes "
        "by default (%s); using %s instead (set %s to choose).",
        key,
        cfg.model.name,
        cfg.model.context_length,
        cfg.data.name,
        default,
        fitted,
        key,
    )


def _keys(overrides: Sequence[str]) -> set[str]:
    return {o.split("=")[0].lstrip("+~") for o in overrides}


def _shown(value: object) -> str:
    """A setting as the command line writes it."""
    return str(getattr(value, "value", value)).lower()


def fit_tokenizer(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """The data's tokenizer and the model's vocabulary made to agree. `data.tokenizer=bpe:N`
    becomes the `tokenizer.json` trained on the text data set's training split (trained on
    first use, then cached: see `zoo.data.tokens`), so that the run's config names the very
    file its ids come from (a fine-tune from the run reuses it, whatever data it reads). A
    model whose `model.vocab_size` the overrides leave at zoo's default takes the tokenizer's
    number of ids (said in one line); one they set (a checkpoint's) that is too small is a
    `ZooError` naming both."""
    setting = cfg.data.get("tokenizer")
    if setting is None:
        return
    if bpe_size(setting) is not None:
        params = OmegaConf.to_container(cfg.data, enum_to_str=True)
        cfg.data.tokenizer = str(trained_tokenizer(**params))
        log.info(
            "data.tokenizer=%s: the BPE tokenizer trained on data set '%s''s training text, "
            "cached as %s (the run keeps a copy as tokenizer.json in its workdir).",
            setting,
            cfg.data.name,
            cfg.data.tokenizer,
        )
    if "vocab_size" not in cfg.model:
        return
    path, vocab = cfg.data.tokenizer, cfg.model.vocab_size
    size = load_tokenizer(path).get_vocab_size()
    if "model.vocab_size" not in _keys(overrides) and vocab != size:
        cfg.model.vocab_size = size
        log.info(
            "model.vocab_size=%d: the ids of the tokenizer data.tokenizer=%s (model '%s' has %s "
            "by default; set model.vocab_size to choose).",
            size,
            setting,
            cfg.model.name,
            vocab,
        )
    elif vocab is not None and size > vocab:
        raise ZooError(
            f"The tokenizer data.tokenizer={path} has {size} ids, more than the model's "
            f"vocabulary of model.vocab_size={vocab}: use the tokenizer that came with the "
            f"checkpoint, or a model with model.vocab_size={size}."
        )


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

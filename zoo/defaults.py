"""zoo's own defaults fitted, at composition, to the model a run builds, each change said in one
console line (as the warm-up and dispatch defaults are, `zoo.overrides`): a value the overrides
set stays as it is, and one that cannot work is a `ZooError` before anything is built.

- `fit_normalisation`: a model that normalises its pixels itself (a pretrained ViT or ResNet)
  reads its data set's pixels unnormalised.
- `fit_context`: a text data set's default lengths (`data.window`, `data.buckets`) are cut to
  a model with fewer positions (a GPT-2 checkpoint's `n_positions`).
- `fit_tokenizer`: `data.tokenizer=bpe:N` becomes the tokenizer trained on the training text,
  and a model's default vocabulary becomes the tokenizer's.
- `fit_epochs`: `trainer.epochs=N` becomes `trainer.steps`, from the training split's size.
- `fit_finetune_defaults`: a fine-tune of a pretrained checkpoint takes the optimizer settings
  of its kind (LoRA, full) in place of the model's, which are for training from scratch.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from zoo.data.text import bpe_size, load_tokenizer, trained_tokenizer
from zoo.engine import registry
from zoo.engine.errors import ZooError
from zoo.engine.loop import check_keys
from zoo.engine.pipeline import training_rows
from zoo.pretrained import is_pretrained_dir

log = logging.getLogger("zoo")


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
    and adds the context itself (`data.buckets`), as do the buckets of a data set without modes
    (`chat`). A length the overrides set that is longer than the context is a `ZooError`,
    before anything is built."""
    context, data = cfg.model.get("context_length"), cfg.data
    if context is None:
        return
    given, lines = _keys(overrides), _shown(data.get("mode", "lines")) == "lines"
    window = data.get("window")
    if window is not None and not lines and window > context:
        _refuse_given("data.window", window, window, cfg, given)
        data.window = context
        _said_fitted("data.window", cfg, f"windows of {window} tokens", f"windows of {context}")
    buckets = list(data.get("buckets") or [])
    # A reward fine-tune's completions follow its prompts in the same rows (all but a
    # completion's last token read): the prompts' buckets leave them room.
    follows = _completion_room(cfg)
    room = context - follows
    if buckets and lines and 0 < room < max(buckets):
        _refuse_given("data.buckets", buckets, max(buckets) + follows, cfg, given, room)
        data.buckets = sorted({b for b in buckets if b < room} | {room})
        _said_fitted("data.buckets", cfg, f"buckets {buckets}", f"buckets {list(data.buckets)}")


def _completion_room(cfg: DictConfig) -> int:
    """The tokens a reward fine-tune's completion adds to its prompt's row (0 otherwise): its
    `max_completion_length`, less the last token, which the model does not read. Only for
    `data=prompts`, what it samples from: other data is refused by name when its first batch
    is seen (`finetune.method=grpo samples completions of prompts`), not fitted first."""
    finetune = cfg.get("finetune") or {}
    if _shown(finetune.get("method")) != "grpo" or cfg.data.get("name") != "prompts":
        return 0
    return finetune.grpo.max_completion_length - 1


def _refuse_given(
    key: str, value: object, length: int, cfg: DictConfig, given: set[str], most: int = 0
) -> None:
    """A `ZooError` when the overrides set `key`, whose `value` makes sequences of `length`
    (`most`: the largest value that fits, the context's length unless given)."""
    if key in given:
        context = cfg.model.context_length
        raise ZooError(
            f"{key}={value} would give model '{cfg.model.name}' sequences of {length} tokens, "
            f"more than model.context_length={context}, the positions it has: use a {key} of "
            f"at most {most or context}, or leave {key} out to have it fitted."
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


def fit_epochs(cfg: DictConfig, overrides: Sequence[str], train: Any = None) -> None:
    """`trainer.epochs=N`: `trainer.steps` becomes ceil(N x rows / trainer.batch_size), the
    rows being those of the training split (`train`, the caller's own data, else the data
    set's, read for it), said in one line. The pipeline runs its batches across epoch
    boundaries, so a partial last batch is a whole step, filled from the next epoch's order. A
    `trainer.steps_per_dispatch` the overrides set rounds the steps up to a multiple of it (a
    model's default one is fitted to the steps instead, by `zoo.overrides`). `trainer.steps`
    set beside it is a `ZooError`. The same data gives the same steps: a resume is exact."""
    trainer = cfg.trainer
    epochs, given = trainer.epochs, _keys(overrides)
    if epochs is None:
        return
    if "trainer.steps" in given:
        raise ZooError(
            f"trainer.epochs={epochs} and trainer.steps={trainer.steps} are both set, and "
            "trainer.epochs computes the steps from the training split's size: set one of them "
            "(trainer.epochs=null trains trainer.steps)."
        )
    if epochs < 1 or trainer.batch_size < 1:
        return  # `validate` names the bad value
    rows = training_rows(_training_split(cfg) if train is None else train)
    steps = math.ceil(epochs * rows / trainer.batch_size)
    dispatch = int(trainer.steps_per_dispatch)
    rounded = "trainer.steps_per_dispatch" in given and dispatch > 1 and steps % dispatch != 0
    if rounded:
        steps += dispatch - steps % dispatch
    trainer.steps = steps
    packed = "packed training rows" if cfg.data.get("packing") else "training examples"
    log.info(
        "trainer.epochs=%d: %d steps of %d rows over the %s %s of data set '%s'%s.",
        epochs,
        steps,
        trainer.batch_size,
        f"{rows:,}",
        packed,
        cfg.data.name,
        f" (rounded up to a multiple of trainer.steps_per_dispatch={dispatch})" if rounded else "",
    )


def _training_split(cfg: DictConfig) -> Any:
    """The run's training split, read from its data set (the trainer reads it again: its
    warnings, a skipped row's, are said then, once)."""
    check_keys(cfg)  # a key the data set's loader does not take is named, not passed to it
    params = OmegaConf.to_container(cfg.data, resolve=True)
    with _quiet():
        return registry.get_data(cfg.data.name).splits(params).train


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """zoo's log lines below errors held back for a while."""
    zoo_log = logging.getLogger("zoo")
    level = zoo_log.level
    zoo_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        zoo_log.setLevel(level)


FINETUNE_DEFAULTS: dict[str, dict[str, Any]] = {
    "LoRA": {"name": "adamw", "learning_rate": 2e-4, "schedule": "cosine", "weight_decay": 0.0},
    "full": {"name": "adamw", "learning_rate": 2e-5, "schedule": "cosine", "weight_decay": 0.0},
}
"""The optimizer settings of a fine-tune of a pretrained checkpoint, by kind (QLoRA: LoRA's),
beside a warm-up of `WARMUP_SHARE` of the steps; see docs/fine-tuning.md for why."""
WARMUP_SHARE = 0.03


def finetune_kind(finetune: Any) -> str | None:
    """`LoRA`, `QLoRA` or `full` for a fine-tune of a pretrained checkpoint directory; None for
    a run from fresh weights or a zoo workdir, and for a head trained alone on a checkpoint's
    frozen backbone (`finetune.freeze=backbone`: a fresh layer, trained from scratch)."""
    start = finetune.init_from
    if not start or not is_pretrained_dir(start):
        return None
    if finetune.lora_rank > 0:
        return "QLoRA" if finetune.quantize else "LoRA"
    return None if finetune.freeze == "backbone" else "full"


def fit_finetune_defaults(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """A fine-tune of a pretrained checkpoint (`finetune_kind`) takes `FINETUNE_DEFAULTS` of
    its kind and a warm-up of `WARMUP_SHARE` of `trainer.steps`, in place of the model's own
    `optimizer.*` defaults (for training from scratch: a `decoder`'s 3e-3 is fifteen times
    LoRA's rate), said in one line; each key the overrides set keeps their value."""
    kind = finetune_kind(cfg.finetune)
    if kind is None:
        return
    given = _keys(overrides)
    values = {
        **FINETUNE_DEFAULTS["full" if kind == "full" else "LoRA"],
        "warmup_steps": round(WARMUP_SHARE * cfg.trainer.steps),
    }
    applied = {k: v for k, v in values.items() if f"optimizer.{k}" not in given}
    if not applied:
        return
    for key, value in applied.items():
        cfg.optimizer[key] = value
    share = f" ({WARMUP_SHARE:.0%} of trainer.steps={cfg.trainer.steps})"
    said = [
        f"optimizer.{key}={value}{share if key == 'warmup_steps' else ''}"
        for key, value in applied.items()
    ]
    log.info(
        "fine-tuning defaults (%s): %s, in place of model '%s''s, which are for training from "
        "scratch (set optimizer.* to choose).",
        kind,
        " ".join(said),
        cfg.model.name,
    )

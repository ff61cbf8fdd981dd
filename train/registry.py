"""The registries of models and data sets, in the style of timm's `@register_model`: a leaf that
only records.

A model is registered once, with everything the generic trainer needs to know about it: its NNX
module constructor, its loss/metrics function, its default data set and any trainer or optimizer
defaults of its own. The constructor's keyword parameters (type-hinted, each with a default) *are*
the model's config schema: the CLI's `model.<param>=...` overrides, `--cfg job` and
`zoo.create_model(name, **overrides)` are all derived from the signature, so a hyper-parameter is
declared exactly once. A model of many options may take them as one typed object instead
(`__init__(self, options: MyOptions, *, rngs)`, `MyOptions` a dataclass): its fields are then
the schema, and the model is built from an instance of it (`options_parameters`). A data set's
loader may do the same with a group of keys it shares with others (`options: ImageOptions`).

Data sets work the same way: a loader function whose keyword parameters are the `data.*` config.
A data set also states what models must know about it (`info`, e.g. `input_shape` and
`num_classes`): a model parameter of the same name left at `None` takes the data set's value, so
`model=cnn data=digits` builds a CNN for 8x8 images without anything else to say.

A model may also load checkpoints of other libraries: it registers each checkpoint family it
understands (`Family`: which `config.json` is one of them, the model's hyper-parameters it
implies, and a table of `Rule`s from checkpoint keys to the model's params); `zoo.engine.weights.pretrained` does
the reading, filling and writing back.

Registering has no other effect: the command line builds its Hydra configs from these records
when it composes a config.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from zoo.engine.errors import ZooError

LossFn = Callable[[nnx.Module, Mapping[str, Any], nnx.Rngs], tuple[Any, dict[str, Any]]]
"""`loss(model, batch, rngs) -> (loss[B], {metric: value[B]})`: per-example values.

Per-example (not batch-mean) values let the trainer average correctly over padded eval batches
and over batches of different sizes, weighting every real example once.
"""

WEIGHT = "weight"
"""A loss function may return this entry among its metrics: each example's weight (e.g. its
number of real tokens). The trainer then averages loss and metrics with these weights instead
of counting every example once, so a per-sequence mean over tokens becomes an exact mean over
all the tokens of the batch or of the eval split."""

LOSS_MASK = "loss_mask"
"""A batch column a language model's loss may read beside `tokens`: 1 for each next-token
target that carries loss, 0 for the others (a chat's system and user turns and its template's
text), so that a model is trained on the replies alone."""

SEGMENT_IDS = "segment_ids"
"""A batch column of packed rows (several sequences end to end in one row, `data.packing`):
the sequence of each input position, 1, 2, ... (0: padding). Only a model whose class sets
`PACKED_ROWS = True` takes packed rows (its attention stays within a sequence, its positions
restart at each); for any other, data with this column is refused before the model is built."""

POSITIONS = "positions"
"""A batch column of packed rows beside `SEGMENT_IDS`: each input position's position within
its own sequence (0 at each sequence's first token)."""

PAIR_SLOTS = "pair_slots"
"""A batch column of packed preference pairs ([batch, slots]): 1 where a row holds a pair as
segment slot + 1 of both its sequences (the chosen replies' and the rejected replies'), 0 for
the slots left empty; a fixed number of slots per data set gives the losses a fixed shape."""


def real_inputs(length: Any, width: int, segment_ids: Any = None) -> Any:
    """Which of a batch's `width` input positions hold a sequence's token [rows, width]: those
    up to each row's `length` real targets (the last target's input included), or for packed
    rows those of a segment. What a loss over a model's inputs counts (a router's load)."""
    if segment_ids is not None:
        return segment_ids > 0
    return jnp.arange(width)[None, :] <= length[:, None]


@typing.runtime_checkable
class AuxiliaryLoss(typing.Protocol):
    """A model that adds a loss term of its own to whatever loss trains it (a mixture of
    experts: its router's load-balancing loss). A model's own loss adds it itself; the
    post-training objectives (`finetune.method=dpo`, `grpo`) call their policy through
    `with_auxiliary_loss`, so that the term trains with them as it does with the model's loss.

    `with_auxiliary_loss(call, real)`: (`call(self)`, the weighted term to add to the loss,
    what TensorBoard shows of it) over the input tokens that `real` [rows, width] marks
    (`real_inputs`); a term of 0 and no metrics where the model's weight of it is 0."""

    def with_auxiliary_loss(
        self, call: Callable[[Any], Any], real: Any
    ) -> tuple[Any, Any, dict[str, Any]]: ...


OnEval = Callable[[nnx.Module, Any], None]
"""`on_eval(model, report)`: called after each eval with the model in eval mode and a
`zoo.engine.report.reporter.EvalReport` (the step, a key of its own, the first eval batch, every eval batch
on demand, and ways to write text and images to TensorBoard and a line to the console)."""

Sample = Callable[..., list[tuple[list[int], bool]]]
"""`sample(model, prompts, max_new_tokens, sampling, key, eos) -> [(new ids, ended), ...]`: a
language model's completion of each prompt (an array of token ids), drawn with `key` as
`sampling` says (`temperature`, `top_k`, `top_p`), ended by an id of `eos` (the last of the
new ids; `ended` True) or at `max_new_tokens` (`ended` False). What reward fine-tuning samples with
(`finetune.method=grpo`); the model as the trainer holds it (LoRA adapters in place)."""

DATA_FACTS = ("input_shape", "num_classes")
"""What a data set may tell models in its `info`."""

Batch = dict[str, np.ndarray]


def loss_contract(
    columns: Sequence[str], metrics: Sequence[str] = ()
) -> Callable[[LossFn], LossFn]:
    """Mark a loss function with the batch columns it reads (e.g. `image`, `label`), so that
    data without them is refused by name before any model is built, and the metrics it returns
    besides the loss, so that TensorBoard's HParams tab lists every model's metrics."""

    def mark(loss: LossFn) -> LossFn:
        loss.columns, loss.metrics = tuple(columns), tuple(metrics)
        return loss

    return mark


@dataclasses.dataclass(frozen=True)
class Splits:
    """A data set: per split, column name -> array (the same leading length), a random-access
    source of records, or a `zoo.engine.pipeline.batches.ExampleSource` that makes each example itself.

    `transform` runs on every batch of both splits (e.g. uint8 pixels -> normalised float32);
    `augment` on training batches only, before `transform`, with a generator seeded from the run's
    seed and the batch's index, so augmentations are the same on every rerun and after a resume.
    Each returns the columns it changes; the others pass through. Both work on whole batches,
    since one vectorised call per batch costs far less than one per example.
    `tokenizer`: the tokenizer (a `tokenizers.Tokenizer`) whose ids a text data set's `tokens`
    hold, so that what a model writes can be decoded; None for bytes or non-text data."""

    train: Mapping[str, np.ndarray]
    eval: Mapping[str, np.ndarray]
    transform: Callable[[Batch], Batch] | None = None
    augment: Callable[[Batch, np.random.Generator], Batch] | None = None
    tokenizer: Any = None
    workers: int = 0
    """Processes that make the training batches (decode, augment, transform); 0: the training
    process itself. Worth it only when making a batch costs more than starting them (seconds)."""
    class_names: Sequence[str] | None = None
    """The names of labels 0, 1, ... where the data decides them (a folder's classes, a
    table's); None: the registered data set's `class_names`, or the numbers."""
    prompts: Callable[[], Sequence[Any]] | None = None
    """Held-out prompts a chat model's eval hook replies to (`zoo.engine.report.reporter.ReplyPrompt`s),
    made when first asked for; None: data with no replies (text, images)."""
    records: Mapping[str, Sequence[Mapping[str, Any]]] | None = None
    """Per split ("train", "eval"), each example's other columns (host-side, any JSON values),
    which reward functions read: a batch's `row` column indexes them; None: no such columns."""
    end_of_turn: Sequence[int] = ()
    """The token ids that end a reply (a chat template's end-of-turn tokens), at which sampled
    completions stop; (): none (they run to their length)."""


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    """Everything the trainer needs to know about one model family."""

    name: str
    constructor: Callable[..., nnx.Module]
    loss: LossFn
    default_data: str
    config: type
    trainer: Mapping[str, Any]
    optimizer: Mapping[str, Any]
    data: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    on_eval: OnEval | None = None
    tiny: tuple[str, ...] = ()
    sample: Sample | None = None

    @property
    def columns(self) -> tuple[str, ...] | None:
        """The batch columns its loss reads (None: not declared, see `loss_contract`)."""
        return getattr(self.loss, "columns", None)

    @property
    def metrics(self) -> tuple[str, ...]:
        """The metrics its loss returns besides the loss (as `loss_contract` declares)."""
        return getattr(self.loss, "metrics", ())

    def resolve(
        self,
        hparams: Mapping[str, Any],
        data: DataEntry,
        data_params: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """`hparams` with each parameter left at None that the data set knows filled in; given
        the data set's config (`data_params`), also what it decides from that (a folder's
        classes, the image size)."""
        resolved = dict(hparams)
        if all(resolved.get(key, 0) is not None for key in DATA_FACTS):
            return resolved  # nothing to ask the data set (which may have to read its files)
        for key, value in data.facts(data_params).items():
            if key in resolved and resolved[key] is None:
                resolved[key] = list(value) if isinstance(value, tuple) else value
        return resolved

    def build(self, hparams: Mapping[str, Any], rngs: nnx.Rngs) -> nnx.Module:
        params = {k: v for k, v in hparams.items() if k != "name"}
        missing = [k for k, v in params.items() if v is None and k in DATA_FACTS]
        if missing:
            raise ZooError(
                f"Model '{self.name}' needs {', '.join(missing)}, which come from its data set: "
                f"resolve the parameters with a data set first, or set model.{missing[0]}."
            )
        return call_with_options(self.constructor, params, rngs=rngs)


@dataclasses.dataclass(frozen=True)
class DataEntry:
    """A registered data set. `info` holds the facts that are the same for every config;
    `describe(**params)` (if any) returns those that its config decides, cheaply (the number
    of class folders, the image size), so a model can be checked before any data is loaded."""

    name: str
    load: Callable[..., Splits]
    config: type
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    describe: Callable[..., Mapping[str, Any]] | None = None
    class_names: tuple[str, ...] | None = None  # label i is class_names[i]; None: the numbers

    def splits(self, params: Mapping[str, Any]) -> Splits:
        return call_with_options(self.load, _without_name(params))

    @property
    def decides(self) -> set[str]:
        """The model parameters this data set fills in."""
        return set(self.info) | (set(DATA_FACTS) if self.describe is not None else set())

    def facts(self, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """`info`, plus what `params` (the data set's config) decide when given."""
        described = {}
        if self.describe is not None and params is not None:
            described = self.describe(**_without_name(params))
        return {**self.info, **described}


def _without_name(params: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if k != "name"}


def _same(array: np.ndarray) -> tuple[np.ndarray, ...]:
    return (array,)


def _only(*arrays: np.ndarray) -> np.ndarray:
    (array,) = arrays
    return array


@dataclasses.dataclass(frozen=True)
class Rule:
    """One row of a checkpoint family's table: the checkpoint keys that `key` (a regex, matched
    in full) names fill the params `params` (NNX state paths, dotted; `\\1`, `\\2`, ... stand
    for `key`'s groups, e.g. the layer index).

    `load(array) -> tuple of arrays`, one per path of `params`, does the transform (transpose,
    split of a fused qkv, reshape to heads); `save(*arrays) -> array` is its inverse, for export.
    `export_key` is the key written on export (with the same `\\1` groups); None: `key` itself,
    for a key without regex syntax. `pad_rows`: the rows of zeros the (single) param has beyond
    the tensor's, e.g. a vocabulary padded so that it shards; written straight into the
    param's buffers on load, dropped on export."""

    key: str
    params: tuple[str, ...]
    load: Callable[[np.ndarray], tuple[np.ndarray, ...]] = _same
    save: Callable[..., np.ndarray] = _only
    export_key: str | None = None
    pad_rows: int = 0


@dataclasses.dataclass(frozen=True)
class Combine:
    """Tensors that a checkpoint stores as parts of one, such as MXFP4's blocks and scales: the
    stored keys `<key><part>` for each of `parts` (`("_blocks", "_scales")`) make the tensor
    `<key>` that the rules' table maps, where `key` (a regex, matched in full) names it and the
    config's `quantization_config.quant_method` is `quant_method`.

    `shape(*parts)` gives the tensor's shape from each part's (shape, dtype), raising
    `ValueError` (why) where they do not fit; `decode(*arrays, dtype=...)` gives the tensor, in
    `dtype`. The reader checks every part present and fitting before anything is built, and
    decodes each tensor only when it copies it."""

    key: str
    parts: tuple[str, ...]
    quant_method: str
    shape: Callable[..., tuple[int, ...]]
    decode: Callable[..., np.ndarray]


@dataclasses.dataclass(frozen=True)
class Family:
    """A family of checkpoints of another library that the model `model` loads, e.g. GPT-2 of
    Hugging Face transformers for `gpt`.

    - `matches(config_json)`: whether a checkpoint directory's `config.json` is of this family;
    - `hparams(config_json)`: the zoo model's constructor arguments it implies;
    - `rules`: the table from checkpoint keys to params (a sequence of `Rule`), or a function of
      the hparams giving it (when a transform depends on a size, such as padded rows);
    - `ignore`: regexes of checkpoint keys that are not params (buffers, tied copies);
    - `ignored(hparams)`: more such regexes for a checkpoint of `hparams` (DeepSeek V3's
      multi-token-prediction layers, numbered after its last layer);
    - `export_config(hparams)`: the `config.json` written on export (None: no export);
    - `description`: one line for listings, e.g. "GPT-2 (transformers GPT2LMHeadModel)";
    - `facts`: anything else the model's code wants to know (e.g. input normalisation);
    - `stacked(hparams)`: the param prefixes whose layers the model stacks along a leading
      axis (`nnx.scan`), e.g. ("blocks",): the rules' per-layer paths `blocks.<i>.<rest>`
      then fill (and export) slice i of `blocks.<rest>`;
    - `honoured`: the `config.json` keys that `hparams` reads (and refuses at a value the model
      does not implement, with a `ZooError` naming the key, its value and what is valid);
    - `inert`: the keys of this family's configs that do not change what the model computes
      (dropout rates, initialisation, the labels' names), besides `COMMON_INERT`, which every
      Hugging Face config carries;
    - `sidecars`: other JSON files of a checkpoint directory that `hparams` reads, e.g.
      `preprocessor_config.json`: one that is present reaches `hparams` as the config's entry
      named by the file's stem (`config["preprocessor_config"]`);
    - `combine`: tensors stored as parts when the config says they are quantized (`Combine`),
      read as the tensors the rules map;
    - `by_default`: False for a family that loads another model's checkpoints only when this
      model is named (`model=vit` on a `SiglipModel` directory, which is model `siglip`'s
      otherwise).

    A key of a nested object is named with dots (`model_args.embed_dim`,
    `preprocessor_config.image_mean`); an object named whole is accounted for whole. Every
    other key is unaccounted for (`unaccounted`): the checkpoint still loads, and a warning
    names the key and its value, since it may change the computation. A family that lists no
    `honoured` keys is not checked."""

    name: str
    model: str
    matches: Callable[[Mapping[str, Any]], bool]
    hparams: Callable[[Mapping[str, Any]], dict[str, Any]]
    rules: Sequence[Rule] | Callable[[Mapping[str, Any]], Sequence[Rule]]
    ignore: tuple[str, ...] = ()
    export_config: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    description: str = ""
    facts: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    stacked: Callable[[Mapping[str, Any]], Sequence[str]] = lambda hparams: ()
    honoured: tuple[str, ...] = ()
    inert: tuple[str, ...] = ()
    sidecars: tuple[str, ...] = ()
    combine: tuple[Combine, ...] = ()
    ignored: Callable[[Mapping[str, Any]], Sequence[str]] = lambda hparams: ()
    by_default: bool = True

    def rules_for(self, hparams: Mapping[str, Any]) -> tuple[Rule, ...]:
        return tuple(self.rules(hparams) if callable(self.rules) else self.rules)

    def ignore_for(self, hparams: Mapping[str, Any]) -> tuple[str, ...]:
        """The regexes of the keys a checkpoint of `hparams` holds that are not params."""
        return (*self.ignore, *self.ignored(hparams))

    def unaccounted(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The keys of `config` (dotted within nested objects) that the family neither honours
        nor lists as inert, with their values; {} for a family that lists no keys. A key of
        `COMMON_REFUSED` at a value other than its inert ones is refused (`ZooError`)."""
        if not self.honoured:
            return {}
        _refuse_common(self.name, config)
        known = {*self.honoured, *self.inert, *COMMON_INERT, *COMMON_REFUSED}
        return _unaccounted(config, known, "")


COMMON_INERT = (
    "_name_or_path",
    "_commit_hash",
    "_attn_implementation",
    "_attn_implementation_autoset",
    "architectures",
    "model_type",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_bfloat16",
    "torchscript",
    "return_dict",
    "output_attentions",
    "output_hidden_states",
    "output_scores",
    "return_dict_in_generate",
    "use_cache",
    "chunk_size_feed_forward",
    "gradient_checkpointing",
    "initializer_range",
    "problem_type",
    "finetuning_task",
    "tf_legacy_loss",
    "tokenizer_class",
    "prefix",
    "task_specific_params",
    "label2id",
    "_num_labels",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "sep_token_id",
    "decoder_start_token_id",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "tie_encoder_decoder",
    "is_decoder",
    "cross_attention_hidden_size",
    # generation settings that transformers 4 kept in config.json (generation_config.json now)
    "max_length",
    "min_length",
    "do_sample",
    "early_stopping",
    "num_beams",
    "num_beam_groups",
    "diversity_penalty",
    "temperature",
    "top_k",
    "top_p",
    "typical_p",
    "repetition_penalty",
    "length_penalty",
    "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size",
    "bad_words_ids",
    "num_return_sequences",
    "remove_invalid_values",
    "exponential_decay_length_penalty",
    "suppress_tokens",
    "begin_suppress_tokens",
)
"""Keys that Hugging Face configs carry whatever the model (`PretrainedConfig`'s own: names,
versions, dtypes, what a forward call returns, token ids and generation settings) and that do
not change the logits."""

COMMON_REFUSED: Mapping[str, tuple[Any, ...]] = {
    "pruned_heads": ({}, None),
    "add_cross_attention": (False, None),
    "is_encoder_decoder": (False, None),
}
"""Keys every Hugging Face config may carry that are inert only at these values (heads pruned
away, cross-attention layers and an encoder-decoder are models zoo does not build)."""


def _refuse_common(family: str, config: Mapping[str, Any]) -> None:
    for key, inert in COMMON_REFUSED.items():
        if key in config and config[key] not in inert:
            raise ZooError(
                f"This {family} checkpoint's config.json has {key}={config[key]!r}, which zoo "
                f"does not build; it loads {key}={inert[0]!r} (or no {key})."
            )


def _unaccounted(config: Mapping[str, Any], known: set[str], prefix: str) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if name in known:
            continue
        if isinstance(value, Mapping) and any(k.startswith(f"{name}.") for k in known):
            found.update(_unaccounted(value, known, f"{name}."))
        else:
            found[name] = value
    return found


_MODELS: dict[str, ModelEntry] = {}
_DATASETS: dict[str, DataEntry] = {}
_FAMILIES: dict[str, Family] = {}


def register_model(
    name: str,
    constructor: Callable[..., nnx.Module] | None = None,
    *,
    loss: LossFn,
    default_data: str,
    trainer: Mapping[str, Any] | None = None,
    optimizer: Mapping[str, Any] | None = None,
    data: Mapping[str, Any] | None = None,
    on_eval: OnEval | None = None,
    tiny: Sequence[str] = (),
    sample: Sample | None = None,
) -> Any:
    """Register an NNX module constructor under `name`; usable as a class decorator.

    `trainer`, `optimizer` and `data` are this model's defaults for those config sections (for
    example `{"steps": 2000}`; `data` applies to whichever data set is chosen); the command
    line still overrides them. `on_eval(model, report)` runs after every eval (see `OnEval`).
    `tiny`: command-line overrides that make the model and its data small enough to build and
    train in a second (`("model.depth=1", "model.dim=16")`); zoo's conformance suite runs
    every registered model, a plugin's too, with them. `sample`: how a language model
    completes prompts for reward fine-tuning (see `Sample`).
    """

    def register(ctor: Callable[..., nnx.Module]) -> Callable[..., nnx.Module]:
        if name in _MODELS:
            raise ZooError(f"A model named '{name}' is already registered; choose another name.")
        schema = _signature_dataclass(ctor, name, f"{_camel(name)}ModelConfig")
        _MODELS[name] = ModelEntry(
            name,
            ctor,
            loss,
            default_data,
            schema,
            dict(trainer or {}),
            dict(optimizer or {}),
            dict(data or {}),
            on_eval,
            tuple(tiny),
            sample,
        )
        return ctor

    return register if constructor is None else register(constructor)


def register_data(
    name: str,
    load: Callable[..., Splits] | None = None,
    *,
    input_shape: tuple[int, ...] | None = None,
    num_classes: int | None = None,
    describe: Callable[..., Mapping[str, Any]] | None = None,
    class_names: Sequence[str] | None = None,
) -> Any:
    """Register a data-set loader under `name`; usable as a function decorator.

    `input_shape` (one example's, e.g. `(28, 28, 1)`) and `num_classes` are what models built
    for this data set need to know; see `ModelEntry.resolve`. A data set whose config decides
    them gives `describe(**params) -> {"input_shape": ..., "num_classes": ...}` instead.
    `class_names` name the labels where TensorBoard shows them (the confusion matrix,
    misclassified examples)."""

    def register(fn: Callable[..., Splits]) -> Callable[..., Splits]:
        if name in _DATASETS:
            raise ZooError(f"A data set named '{name}' is already registered; choose another.")
        schema = _signature_dataclass(fn, name, f"{_camel(name)}DataConfig")
        info = {"input_shape": input_shape, "num_classes": num_classes}
        _DATASETS[name] = DataEntry(
            name,
            fn,
            schema,
            {k: v for k, v in info.items() if v is not None},
            describe,
            tuple(class_names) if class_names else None,
        )
        return fn

    return register if load is None else register(load)


def register_family(family: Family) -> Family:
    """Record a checkpoint family that a registered model loads (see `Family`)."""
    if family.name in _FAMILIES:
        raise ZooError(f"A checkpoint family named '{family.name}' is already registered.")
    _FAMILIES[family.name] = family
    return family


def register_families(model: str, *layouts: Sequence[Any], **shared: Any) -> tuple[Family, ...]:
    """Record the checkpoint families of `model`, one a layout: (name, matches, hparams, rules,
    export_config, description) as `Family` has them, optionally followed by a mapping of the
    layout's other fields (`honoured`, `inert`, ...); `shared`: the fields they have in common
    (`ignore`, ...)."""
    return tuple(
        register_family(
            Family(
                name,
                model,
                matches,
                hparams,
                rules,
                export_config=config,
                description=text,
                **shared,
                **(own[0] if own else {}),
            )
        )
        for name, matches, hparams, rules, config, text, *own in layouts
    )


def families(model: str | None = None) -> list[Family]:
    """The registered checkpoint families (of `model` only, if given), by name."""
    return [f for _, f in sorted(_FAMILIES.items()) if model is None or f.model == model]


def list_models() -> list[str]:
    """Names of the registered models, sorted."""
    return sorted(_MODELS)


def list_datasets() -> list[str]:
    """Names of the registered data sets, sorted."""
    return sorted(_DATASETS)


def get_model(name: str) -> ModelEntry:
    if name not in _MODELS:
        raise ZooError(
            f"Unknown model '{name}'. Registered models: {', '.join(list_models())}. A model that "
            "a plugin module registers exists once the module is imported (on a command line: "
            "ZOO_PLUGINS=MODULE)."
        )
    return _MODELS[name]


def get_data(name: str) -> DataEntry:
    if name not in _DATASETS:
        raise ZooError(
            f"Unknown data set '{name}'. Registered data sets: {', '.join(list_datasets())}."
        )
    return _DATASETS[name]


def options_parameters(fn: Callable[..., Any]) -> dict[str, type]:
    """The parameters of `fn` (a model's constructor, a data set's loader) that take a group of
    options as one typed object (`options: DecoderOptions`, `options: ImageOptions`): typed as
    a dataclass and without a default. Each stands for its dataclass's fields in the config
    schema, and is built from them by `call_with_options`."""
    hints = _hints(fn)
    return {
        p.name: hints[p.name]
        for p in _parameters(fn)
        if p.default is p.empty
        and isinstance(hints.get(p.name), type)
        and dataclasses.is_dataclass(hints[p.name])
    }


def call_with_options(fn: Callable[..., Any], keys: Mapping[str, Any], **extra: Any) -> Any:
    """`fn` called with its config `keys`: those of each options parameter gathered into its
    dataclass (whose checks run there), the others passed as they are, `extra` besides."""
    given = dict(keys)
    for parameter, options in options_parameters(fn).items():
        names = [f.name for f in dataclasses.fields(options)]
        given[parameter] = options(**{n: given.pop(n) for n in names if n in given})
    return fn(**given, **extra)


def _parameters(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    """`fn`'s parameters (a class's constructor's, without `self`)."""
    target = fn.__init__ if inspect.isclass(fn) else fn
    return list(inspect.signature(target).parameters.values())[inspect.isclass(fn) :]


def _hints(fn: Callable[..., Any]) -> dict[str, Any]:
    """The type hints of `fn`'s parameters (a class's constructor's)."""
    return typing.get_type_hints(fn.__init__ if inspect.isclass(fn) else fn)


def _signature_dataclass(fn: Callable[..., Any], name: str, class_name: str) -> type:
    """A dataclass of `fn`'s config keys (`_keywords`), plus `name` = the registry key."""
    fields: list[tuple[str, Any, Any]] = [("name", str, dataclasses.field(default=name))]
    for key, hint, default, owner in _keywords(fn):
        if default is inspect.Parameter.empty or hint is None:
            raise ZooError(
                f"Cannot register '{name}': parameter '{key}' of {owner.__qualname__} needs a "
                "type hint and a default value, since it becomes a config key."
            )
        if isinstance(default, list | dict):
            field = dataclasses.field(default_factory=lambda d=default: type(d)(d))
        else:
            field = dataclasses.field(default=default)
        fields.append((key, hint, field))
    return dataclasses.make_dataclass(class_name, fields)


def _keywords(fn: Callable[..., Any]) -> list[tuple[str, Any, Any, Any]]:
    """(name, type hint or None, default or `Parameter.empty`, where it is declared) of `fn`'s
    config keys: its parameters but `rngs`, each options parameter replaced by its fields."""
    hints, grouped = _hints(fn), options_parameters(fn)
    keys = []
    for param in _parameters(fn):
        if param.name in grouped:
            keys += [
                (*field, grouped[param.name]) for field in _options_fields(grouped[param.name])
            ]
        elif param.name != "rngs" and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            keys.append((param.name, hints.get(param.name), param.default, fn))
    return keys


def _options_fields(options: type) -> list[tuple[str, Any, Any]]:
    """(name, type hint, default or `Parameter.empty`) of the fields of an options dataclass."""
    hints = typing.get_type_hints(options)
    return [(f.name, hints.get(f.name), _default(f)) for f in dataclasses.fields(options)]


def _default(field: dataclasses.Field) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.replace("-", "_").split("_"))

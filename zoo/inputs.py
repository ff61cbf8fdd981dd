"""What a model reads, and the caller's inputs and data checked against it before the model
runs: `predict`'s inputs (`Reads.check`), the columns of `evaluate`'s and `finetune`'s data
(`check_columns`, `check_data`). What is wrong is a `ZooError` that names the bad value and
what the model takes (strings, a missing batch axis, raw integer pixels, token ids outside the
vocabulary, a shape the model cannot take).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from omegaconf import DictConfig, OmegaConf

from zoo.engine import pipeline, registry, sharding
from zoo.engine.config import MeshConfig, checked_dict
from zoo.engine.errors import ZooError
from zoo.engine.loop import abstract_model, check_split
from zoo.engine.posttraining import DPO, check_method, method_of
from zoo.trained import resolved_hparams

_TRACE_ERRORS = (TypeError, ValueError, IndexError)
"""What jax raises, while tracing, for inputs of a shape or type a model cannot take (and a
model's own refusal: `ZooError` is a `ValueError`)."""
_NOT_NUMBERS = {"U": "strings", "S": "bytes", "O": "Python objects", "c": "complex numbers"}


@dataclasses.dataclass(frozen=True)
class Reads:
    """What a model reads, as far as its hyper-parameters state it: images (or feature
    vectors) in floats, with the axes of `input_shape` (the size it was built for: a model
    that pools may take other sizes); or sequences of integer token ids, `context_length`
    long at most, each below `vocab_size`. Whatever they leave open is decided by tracing the
    model abstractly on the inputs (`jax.eval_shape`, nothing computed): what it cannot take
    fails there, before it runs. `column`: the batch column that holds them (the first its
    loss reads)."""

    model: str
    column: str
    data: str
    shape: tuple[int, ...] | None = None
    context_length: int | None = None
    vocab_size: int | None = None

    @classmethod
    def of(cls, config: DictConfig, hparams: Mapping[str, Any] | None = None) -> Reads:
        """What the model of `config` reads, its `hparams` those `config` resolves to unless
        given."""
        entry = registry.get_model(config.model.name)
        hparams = resolved_hparams(config) if hparams is None else hparams
        shape, length = hparams.get("input_shape"), hparams.get("context_length")
        return cls(
            entry.name,
            (entry.columns or ("inputs",))[0],
            str(config.data.name),
            tuple(shape) if shape else None,
            length if shape is None else None,
            hparams.get("vocab_size") if shape is None and length else None,
        )

    @property
    def states_nothing(self) -> bool:
        return self.shape is None and self.context_length is None

    def decides(self, array: np.ndarray) -> bool:
        """Whether what the model states shows that it takes `array` (checked by `check`)."""
        return self.context_length is not None or array.shape[1:] == self.shape

    def takes(self) -> str:
        """What the model takes, as a sentence."""
        if self.shape is not None:
            kind = "images" if len(self.shape) == 3 else "examples"
            return (
                f"Model '{self.model}' takes a batch (N, {', '.join(map(str, self.shape))}) of "
                f"float {kind} normalised as in training (its input_shape is "
                f"{list(self.shape)})."
            )
        if self.context_length is not None:
            vocabulary = f", each below vocab_size={self.vocab_size}" if self.vocab_size else ""
            return (
                f"Model '{self.model}' takes a batch (N, length) of integer token ids, length "
                f"at most context_length={self.context_length}{vocabulary}."
            )
        return (
            f"Model '{self.model}' takes a batch of examples shaped as the '{self.column}' "
            f"column of its training data (data set '{self.data}')."
        )

    def check(self, values: Any, what: str, examples: bool = False) -> np.ndarray:
        """`values` as an array of numbers with a batch axis, or a `ZooError` that begins with
        `what` ("predict got inputs") and says what they lack; for a model that states its
        inputs, everything those facts require of them. `examples`: `values` are the first
        examples of a data column, which names their shapes without the batch axis and may
        hold a token more than the model reads (the next-token target)."""
        array = numeric_batch(values, what, self.takes())
        if not examples:
            self._check_batch_axis(array, what)
        shape = f"of shape {array.shape[1:] if examples else array.shape} ({array.dtype})"
        if self.shape is not None and array.ndim != len(self.shape) + 1:
            raise ZooError(f"{what} {shape}. {self.takes()}{self.hint()}")
        if self.shape is not None and not jnp.issubdtype(array.dtype, jnp.floating):
            how = (
                f'zoo.load_data("{self.data}").transform({{"image": images}})["image"]'
                if self.data in registry.list_datasets()
                else "the transform its training data had"
            )
            raise ZooError(
                f"{what} {shape}: {array.dtype} images; model '{self.model}' takes float "
                f"images normalised as in training. Normalise them first: {how}."
            )
        if self.context_length is not None:
            self._check_tokens(array, f"{what} {shape}", examples)
        return array

    def _check_batch_axis(self, array: np.ndarray, what: str) -> None:
        if self.shape is not None and array.shape == self.shape:
            noun = "image" if len(self.shape) == 3 else "example"
        elif self.context_length is not None and array.ndim == 1:
            noun = "sequence"
        else:
            return
        raise ZooError(
            f"{what}: one {noun} of shape {array.shape}, without the batch axis; add it "
            f"(inputs[None], shape (1, {', '.join(map(str, array.shape))})). {self.takes()}"
        )

    def _check_tokens(self, array: np.ndarray, what: str, examples: bool) -> None:
        if array.ndim != 2 or array.shape[1] > self.context_length + examples:
            raise ZooError(f"{what}. {self.takes()}")
        if not jnp.issubdtype(array.dtype, jnp.integer):
            raise ZooError(
                f"{what}: not token ids. {self.takes()} Convert them, e.g. tokens.astype(np.int32)."
            )
        high = self.vocab_size
        outside = array[(array < 0) | (array >= high)] if high else array[array < 0]
        if outside.size:
            raise ZooError(
                f"{what}, holding token id {outside.flat[0]}, outside the vocabulary. "
                f"{self.takes()}"
            )

    def check_traced(
        self, graphdef: nnx.GraphDef, state: nnx.State, array: np.ndarray, what: str
    ) -> None:
        """The model (`graphdef`, `state`) traced abstractly on a batch of `array`'s shape and
        on one of another size: each output's leading axis is the batch's. Otherwise a
        `ZooError`: one example without its batch axis (if `array[None]` would do), or a shape
        the model cannot take."""

        def call(state: nnx.State, inputs: jax.Array) -> Any:
            return nnx.merge(graphdef, state)(inputs)

        def maps_batches(shape: tuple[int, ...]) -> str | None:
            """None if the model takes a batch of `shape`; else why not."""
            try:
                with sharding.unsplit_batch():
                    for size in (shape[0], shape[0] + 1):
                        abstract = jax.ShapeDtypeStruct((size, *shape[1:]), array.dtype)
                        outputs = jax.eval_shape(call, state, abstract)
                        if any(np.shape(o)[:1] != (size,) for o in jax.tree.leaves(outputs)):
                            return "its outputs do not have the batch's leading axis"
            except _TRACE_ERRORS as e:  # jax's error, or the model's own refusal
                return _reason(e)
            return None

        reason = maps_batches(array.shape)
        if reason is None:
            return
        if self.states_nothing and maps_batches((1, *array.shape)) is None:
            raise ZooError(
                f"{what}: one example of shape {array.shape}, without the batch axis; add it "
                f"(inputs[None], shape (1, {', '.join(map(str, array.shape))})). "
                f"{self.takes()}"
            )
        raise ZooError(
            f"{what} of shape {array.shape} ({array.dtype}), which model '{self.model}' cannot "
            f"take: {reason}. {self.takes()}{self.hint()}"
        )

    def hint(self) -> str:
        """What to do about images of another shape (nothing for other inputs)."""
        if self.shape is None or len(self.shape) != 3:
            return ""
        return (
            " Add a missing channel axis with images[..., None], and resize images of another size."
        )


def numeric_batch(values: Any, what: str, takes: str) -> np.ndarray:
    """`values` as one array of numbers with a batch axis, or a `ZooError` naming what it is."""
    try:
        array = np.asarray(values)
    except ValueError as e:  # rows of different lengths
        raise ZooError(
            f"{what} that do not make one array ({_reason(e)}). {takes} Pass one array whose "
            "examples all have one shape."
        ) from None
    kind = _NOT_NUMBERS.get(array.dtype.kind)
    if kind is not None or not (array.dtype == bool or jnp.issubdtype(array.dtype, jnp.number)):
        raise ZooError(
            f"{what} of {kind or array.dtype.name} (dtype {array.dtype}), which a model cannot "
            f"compute with. {takes} Convert or encode them as numbers first."
        )
    if array.ndim == 0:
        raise ZooError(f"{what} of one number ({array}), not a batch. {takes}")
    return array


def check_columns(
    config: DictConfig, hparams: Mapping[str, Any], split: str, data: Any, transform: Any
) -> None:
    """One split of the caller's data (columns, or a random-access source) for the model of
    `config` (of `hparams`): every column a batch of examples, the columns its loss reads
    present, labels within its classes, and its first example, as the model sees it
    (transformed), numbers of the kind it takes (`Reads`). Else a `ZooError` naming what is
    wrong."""
    if isinstance(data, Mapping):
        for name, column in data.items():
            if np.ndim(column) == 0:
                raise ZooError(
                    f"The {split} data's column '{name}' holds one value ({column!r}), not a "
                    "batch: each column holds one row per example, e.g. a (N, ...) array."
                )
    entry = registry.get_model(config.model.name)
    check_split(entry, split, data, hparams)
    first = pipeline.eval_batches(data, 1)[0]
    try:
        first = {**first, **transform(first)} if transform is not None else first
    except ZooError:
        raise
    except (TypeError, ValueError) as e:  # the caller's transform
        raise ZooError(
            f"The {split} data's transform fails on its first example: {type(e).__name__}: "
            f"{_reason(e)}."
        ) from None
    reads = Reads.of(config, hparams)
    pairs = method_of(config.finetune) == DPO  # the model reads each pair's two sequences
    for name in entry.columns or ():
        what = f"The {split} data's '{name}' column holds examples"
        if name == reads.column and pairs:
            check_method(config.finetune, first)
            reads.check(_sequences(first[name]), f"{what} (pairs: each of its two rows)", True)
        elif name == reads.column:
            reads.check(first[name], what, examples=True)
        else:
            numeric_batch(first[name], what, f"Model '{entry.name}' reads it as numbers.")


def _sequences(pairs: Any) -> np.ndarray:
    """A batch of pairs [N, 2, ...] as the 2N sequences the model reads."""
    pairs = np.asarray(pairs)
    return pairs.reshape(-1, *pairs.shape[2:])


def check_data(config: DictConfig, splits: registry.Splits) -> None:
    """The caller's data for a run of `config` (`zoo.finetune(..., data=Splits)`), its model
    as `config.model` gives it (no data set decides anything): both splits as `check_columns`
    checks them, and, for a model that states nothing of its inputs, its loss traced
    abstractly on the first training example, before anything is built."""
    hparams = OmegaConf.to_container(config.model)
    for split, data in (("train", splits.train), ("eval", splits.eval)):
        check_columns(config, hparams, split, data, splits.transform)
    reads = Reads.of(config, hparams)
    if not reads.states_nothing:
        return
    entry = registry.get_model(config.model.name)
    mesh, rules = sharding.mesh_and_rules(checked_dict(MeshConfig, {}, "mesh"), jax.devices()[:1])
    first = pipeline.eval_batches(splits.train, 1, transform=splits.transform)[0]
    with sharding.activate(mesh, rules):
        graphdef, state = nnx.split(abstract_model(entry, hparams, 0))

        def loss(state, batch):
            return entry.loss(nnx.merge(graphdef, state), batch, nnx.Rngs(0))

        check_loss_traced(loss, state, first, "train", reads)


def check_loss_traced(
    loss: Any, state: Any, batch: Mapping[str, Any], split: str, reads: Reads
) -> None:
    """`loss(state, batch)` traced abstractly (nothing computed); what the model cannot take
    (jax's error, or the model's own refusal), a `ZooError` naming the batch's columns."""
    try:
        jax.eval_shape(loss, state, batch)
    except _TRACE_ERRORS as e:
        columns = ", ".join(
            f"'{name}' of shape {tuple(np.shape(column))[1:]} ({column.dtype})"
            for name, column in batch.items()
            if name != pipeline.MASK
        )
        raise ZooError(
            f"Model '{reads.model}' cannot read the {split} data's examples ({columns}): "
            f"{_reason(e)}. {reads.takes()}{reads.hint()}"
        ) from None


def _reason(error: Exception) -> str:
    """An error raised while tracing, as a clause of a sentence."""
    return str(error).strip().splitlines()[0].rstrip(".")

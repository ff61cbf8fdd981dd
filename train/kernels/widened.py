"""bfloat16 decoding where zoo's bfloat16 kernel cannot run (no C++ compiler, a CPU without AVX2
nor AVX-512, `ZOO_NATIVE_KERNELS=0`): the weights widened to float32 once, not at every step.

XLA:CPU converts both operands of a bfloat16 product of a few rows to float32 before it multiplies
them, so each decoding step of XLA's bfloat16 products rewrites every weight it reads and runs
several times slower than float32's (`zoo.engine.kernels.bf16_rows`). A decoding session instead
passes its steps a float32 copy of each bfloat16 weight of two axes or more (`copies`), made once
and shared by the sessions over the same weights, and traces its steps inside `reading(weights,
copies)`: a product of a few rows whose kernel is one of those weights multiplies the copy
(`copy_of`), kernel first, as float32 does, and rounds the float32 sums to bfloat16 once. The
arithmetic is XLA's bfloat16 product's (a bfloat16 widens to float32 exactly): bfloat16 operands,
float32 sums, one rounding, only the order of the sums differing; every other use of a weight
reads it as it is. The copies hold twice the bfloat16 weights' memory while a session holds them.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
from zoo.engine.kernels import bf16_rows

_SHARED: dict[int, tuple[weakref.ref, weakref.ref]] = {}
"""id(weight) -> (weight, its float32 copy), both weakly: a copy lives as long as a session
holds it, and is shared by the sessions over the same weight meanwhile."""

_READING: contextvars.ContextVar[dict[int, tuple]] = contextvars.ContextVar("widened")


def copies(weights: Sequence[jax.Array]) -> tuple[jax.Array | None, ...]:
    """A float32 copy of each of `weights` that a decoding step's products would otherwise widen
    at every step (bfloat16, two axes or more, on one CPU device, where zoo's kernel does not
    run); None for the others, and for all of them where the kernel runs."""
    widens = [_widens(w) for w in weights]
    # A float32 model's session neither compiles the kernel nor hears of a missing compiler.
    if not any(widens) or jax.default_backend() != "cpu" or bf16_rows.chosen() is not None:
        return (None,) * len(weights)
    return tuple(_copy(w) if wide else None for w, wide in zip(weights, widens, strict=True))


def _widens(weight: jax.Array) -> bool:
    return (
        isinstance(weight, jax.Array)
        and weight.dtype == jnp.bfloat16
        and weight.ndim >= 2
        and len(weight.sharding.device_set) == 1
    )


def _copy(weight: jax.Array) -> jax.Array:
    """`weight` in float32, the copy shared while anyone holds it."""
    key = id(weight)
    source, copy = (ref() for ref in _SHARED.get(key, (lambda: None, lambda: None)))
    if source is weight and copy is not None:
        return copy
    copy = weight.astype(jnp.float32)

    def forget(_, key=key):
        # Only this copy's entry: the id may since name another weight.
        if _SHARED.get(key, (None, None))[1] is ref:
            del _SHARED[key]

    ref = weakref.ref(copy, forget)
    _SHARED[key] = (weakref.ref(weight), ref)
    return copy


@contextlib.contextmanager
def reading(weights: Sequence[jax.Array], widened: Sequence[jax.Array | None]) -> Iterator[None]:
    """While a step is traced inside it: a product of a few rows by one of `weights` (the traced
    arguments) multiplies its copy in `widened` (those of `copies`) instead."""
    table = {id(w): (w, c) for w, c in zip(weights, widened, strict=True) if c is not None}
    token = _READING.set(table)
    try:
        yield
    finally:
        _READING.reset(token)


def copy_of(kernel: jax.Array) -> jax.Array | None:
    """The float32 copy `reading` gave for `kernel`, or None."""
    weight, copy = _READING.get({}).get(id(kernel), (None, None))
    return copy if weight is kernel else None

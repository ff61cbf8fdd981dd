"""LoRA adapters for the Linear layers of a built model, born sharded like the layers they adapt.

`add_adapters` replaces each chosen `nnx.Linear` by a `ShardedLoRA` that wraps it: the layer's
own params stay where they were (now under `<layer>.base_module`), and the adapter adds
`x @ lora_a @ lora_b` to its output. `lora_a` is annotated with the kernel's input axis and
`lora_b` with its output axis, so the adapters shard as the layer does; `lora_b` starts at zero,
so an adapted model computes exactly what it did before training. Adapter params are
`nnx.LoRAParam` (a `Param` subclass): LoRA-only training differentiates and optimizes
`nnx.LoRAParam` alone. `merge_adapters` folds each adapter into its layer's kernel and puts the
plain layer back.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from zoo.engine.abstract import partitioned
from zoo.engine.errors import ZooError
from zoo.engine.paths import dotted, matches
from zoo.engine.sharding import logical_spec


class ShardedLoRA(nnx.LoRA):
    """`nnx.LoRA` around a Linear layer, saying where each contraction's output lives (explicit
    sharding asks): the rank dimension replicated, the output sharded as the layer's."""

    def __call__(self, x: jax.Array, out_sharding: Any = None) -> jax.Array:
        y = self.base_module(x, out_sharding=out_sharding)
        low = jnp.matmul(
            x, self.lora_a[...], out_sharding=logical_spec("batch", *[None] * (x.ndim - 1))
        )
        return y + jnp.matmul(low, self.lora_b[...], out_sharding=jax.typeof(y).sharding.spec)


def add_adapters(model: nnx.Module, rank: int, layers: str, rngs: nnx.Rngs) -> list[str]:
    """Wrap every `nnx.Linear` whose path `layers` matches; returns their paths. Call it where
    the model is built (under the mesh), so the adapters are born sharded."""
    chosen = [
        (path, module)
        for path, module in nnx.iter_modules(model)
        if type(module) is nnx.Linear and path and matches(layers, path)
    ]
    if not chosen:
        linears = [dotted(p) for p, m in nnx.iter_modules(model) if isinstance(m, nnx.Linear)]
        raise ZooError(
            f"finetune.lora_layers='{layers}' matches none of the model's Linear layers: "
            f"{', '.join(linears) or 'it has none'}."
        )
    for path, linear in chosen:
        axis_in, axis_out = linear.kernel.get_metadata().get("out_sharding") or (None, None)
        adapter = ShardedLoRA(
            linear.in_features,
            rank,
            linear.out_features,
            base_module=linear,
            a_initializer=partitioned(nnx.initializers.he_uniform(), (axis_in, None)),
            b_initializer=partitioned(nnx.initializers.zeros_init(), (None, axis_out)),
            rngs=rngs,
        )
        _replace(model, path, adapter)
    return [dotted(path) for path, _ in chosen]


def merge_adapters(model: nnx.Module) -> nnx.Module:
    """Fold every adapter into its layer (`kernel + lora_a @ lora_b`) and put the plain layer
    back in its place; the model then has its original structure. In place; returns `model`.
    Call it under the model's mesh (`with result.activate():`)."""
    adapters = [(p, m) for p, m in nnx.iter_modules(model) if isinstance(m, ShardedLoRA)]
    for path, adapter in adapters:
        layer = adapter.base_module
        delta = jnp.matmul(
            adapter.lora_a[...],
            adapter.lora_b[...],
            out_sharding=jax.typeof(layer.kernel[...]).sharding.spec,
        )
        layer.kernel[...] = layer.kernel[...] + delta.astype(layer.kernel.dtype)
        _replace(model, path, layer)
    return model


def _replace(model: nnx.Module, path: tuple[Any, ...], new: nnx.Module) -> None:
    parent = model
    for part in path[:-1]:
        parent = parent[part] if isinstance(part, int) else getattr(parent, part)
    if isinstance(path[-1], int):
        parent[path[-1]] = new
    else:
        setattr(parent, path[-1], new)

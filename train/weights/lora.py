"""LoRA adapters for the dense layers of a built model, born sharded like the layers they adapt.

`add_adapters` replaces each chosen `nnx.Linear` (an MLP's layers), `nnx.LinearGeneral` (an
attention's projections to and from heads) or `TransposedLinear` (the same, with the kernel laid
out as PyTorch checkpoints lay it out) by a `ShardedLoRA` that wraps it: the layer's own
params stay where they were (now under `<layer>.base_module`), and the adapter adds
`x @ lora_a @ lora_b` to its output. `lora_a` is annotated with the kernel's input axes and
`lora_b` with its output axes, so the adapters shard as the layer does; `lora_b` starts at zero,
so an adapted model computes exactly what it did before training. Adapter params are
`nnx.LoRAParam` (a `Param` subclass): LoRA-only training differentiates and optimizes
`nnx.LoRAParam` alone. With QLoRA the wrapped layer's kernel is held quantized instead, and a
checkpoint fills it through `QuantizedFill`. `merge_adapters` folds each adapter into its
layer's kernel (dequantized first) and puts the plain layer back. A model's layers stacked for
`nnx.scan` (`scan_layers`) hold each kernel with a leading layer axis; their adapters get the
same leading axis, so that the scan hands each step its own layer's adapter.

A module whose kernels are not dense layers' (a mixture of experts' stacked expert kernels)
adapts itself: one that has `add_lora(rank, rngs)` and `merge_lora()` (`SelfAdapting`) and
whose path `finetune.lora_layers` matches is given its own adapters (`nnx.LoRAParam`s beside its
kernels, which keep their paths) and merges them itself. With QLoRA each of its `KERNELS` is
held quantized in the place of its param (`zoo.engine.weights.quantize.Quantized`, under the
kernel's path: `<kernel>.codes`, `<kernel>.scale`), read dequantized where the module reads the
kernel, and put back dequantized before the module merges its adapters.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from flax import nnx
from zoo.engine.errors import ZooError
from zoo.engine.kernels.dense import TransposedLinear
from zoo.engine.sharding.abstract import partitioned
from zoo.engine.sharding.mesh import logical_spec
from zoo.engine.weights import quantize as quantization
from zoo.engine.weights.paths import dotted, matches


class ShardedLoRA(nnx.Module):
    """A low-rank adapter around a dense layer (`base_module`, one of `ADAPTED`): the layer's
    output plus `x @ lora_a @ lora_b`, contracted over the layer's input axes and spread over
    its output axes (an attention projection to heads x head_dim, or from them). `lora_a` takes
    the kernel's input axes' annotations, `lora_b` its output axes', so the adapter shards as
    the layer does; each contraction says where its output lives (explicit sharding asks), the
    rank dimension replicated. The adapter's output is added in the layer's output dtype, so a
    model held in bfloat16 stays in bfloat16 with float32 adapters. With `quantize` (QLoRA) the
    layer's kernel is held as `codes` and `scale` (`zoo.engine.weights.quantize`), which no optimizer
    sees, and the layer computes with the kernel they stand for, dequantized at each call."""

    def __init__(
        self,
        base_module: Dense,
        rank: int,
        rngs: nnx.Rngs,
        quantize: str | None = None,
        filled: bool = False,
    ):
        kernel = base_module.kernel
        axes = kernel.get_metadata().get("out_sharding") or (None,) * kernel.ndim
        self.stacked = lead = _stacked(base_module)
        self.inputs, self.outputs = ins, outs = _kernel_axes(base_module)
        shape, named = kernel.shape[lead:], axes[lead:]
        in_shape, out_shape = (tuple(shape[i] for i in dims) for dims in (ins, outs))
        in_axes, out_axes = (tuple(named[i] for i in dims) for dims in (ins, outs))
        stack, stack_axes = tuple(kernel.shape[:lead]), tuple(axes[:lead])
        a_init = partitioned(
            nnx.initializers.he_uniform(batch_axis=tuple(range(lead))),
            (*stack_axes, *in_axes, None),
        )
        b_init = partitioned(nnx.initializers.zeros_init(), (*stack_axes, None, *out_axes))
        self.base_module = base_module
        self.lora_a = nnx.LoRAParam(a_init(rngs.params(), (*stack, *in_shape, rank), jnp.float32))
        self.lora_b = nnx.LoRAParam(b_init(rngs.params(), (*stack, rank, *out_shape), jnp.float32))
        self.layout: quantization.Layout | None = None
        if quantize is not None:
            if lead:
                raise ZooError(
                    f"finetune.quantize={quantize} quantizes the kernels of single layers; this "
                    "layer is stacked for scanning (model.scan_layers=true): use "
                    "model.scan_layers=false for QLoRA."
                )
            self._hold_quantized(quantize, tuple(axes), filled)

    def _hold_quantized(self, qtype: str, axes: tuple[Any, ...], filled: bool) -> None:
        """Put codes and scales (`codes`, `scale`, annotated with the kernel's axes as
        `quantize.held` says) in the place of the layer's kernel, which the layer then lacks."""
        self.kernel_axes = axes
        kernel = self.base_module.kernel
        self.layout, self.codes, self.scale = quantization.held(
            kernel, self.inputs[-1], qtype, filled, axes
        )
        self.base_module.kernel = None

    def base_kernel(self) -> jax.Array:
        """The layer's kernel: its own, or the one its codes and scales stand for."""
        if self.layout is None:
            return self.base_module.kernel[...]
        return quantization.dequantize(self.codes[...], self.scale[...], self.layout)

    def set_base_kernel(self, kernel: jax.Array) -> None:
        """Quantize `kernel` into the codes and scales, each kept where it lived."""
        quantization.store(self.codes, self.scale, kernel, self.layout)

    def __call__(self, x: jax.Array, out_sharding: Any = None) -> jax.Array:
        layer = self.base_module
        if self.layout is None:
            y = layer(x, out_sharding=out_sharding)
        else:
            y = type(layer).__call__(_WithKernel(layer, self.base_kernel()), x, out_sharding)
        a, b = self.lora_a[...], self.lora_b[...]
        inputs = a.ndim - 1
        low = jnp.einsum(
            f"...{_LETTERS[:inputs]},{_LETTERS[:inputs]}r->...r",
            x,
            a,
            out_sharding=logical_spec("batch", *[None] * (x.ndim - inputs)),
        )
        outputs = _LETTERS[inputs : inputs + b.ndim - 1]
        delta = jnp.einsum(
            f"...r,r{outputs}->...{outputs}", low, b, out_sharding=jax.typeof(y).sharding.spec
        )
        return y + delta.astype(y.dtype)

    def merged_kernel(self) -> jax.Array:
        """The layer's kernel with the adapter folded in: `kernel + lora_a @ lora_b`, laid out
        as the kernel is (a quantized kernel dequantized first), in the kernel's dtype."""
        kernel = self.base_kernel()
        letters = _LETTERS[: kernel.ndim]
        lead, own = letters[: self.stacked], letters[self.stacked :]
        ins, outs = ("".join(own[i] for i in dims) for dims in (self.inputs, self.outputs))
        delta = jnp.einsum(
            f"{lead}{ins}r,{lead}r{outs}->{letters}",
            self.lora_a[...],
            self.lora_b[...],
            out_sharding=jax.typeof(kernel).sharding.spec,
        )
        return kernel + delta.astype(kernel.dtype)


class _WithKernel:
    """A dense layer seen with `kernel` (an array) in the place of its own: what its own
    `__call__` computes with the dequantized kernel, without changing the layer."""

    def __init__(self, layer: Dense, kernel: jax.Array):
        self.layer, self.kernel = layer, kernel

    def __getattr__(self, name: str) -> Any:
        return getattr(self.layer, name)


_LETTERS = "ijklmnopq"
Dense = nnx.Linear | nnx.LinearGeneral | TransposedLinear


def _kernel_axes(layer: Dense) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Which axes of one layer's kernel (past the axes that stack layers) it contracts with its
    input, and which it gives out: the leading ones are the inputs of a Linear or
    LinearGeneral, the trailing ones of a TransposedLinear."""
    ndim = layer.kernel.ndim - _stacked(layer)
    if isinstance(layer, TransposedLinear):
        outputs = len(layer.out_features)
        return tuple(range(outputs, ndim)), tuple(range(outputs))
    inputs = len(layer.in_features) if isinstance(layer, nnx.LinearGeneral) else 1
    return tuple(range(inputs)), tuple(range(inputs, ndim))


def _stacked(layer: Dense) -> int:
    """How many leading axes of `layer`'s kernel stack copies of the layer beyond the axes its
    features give: 1 for a model's layers stacked for `nnx.scan` (`scan_layers`), whose scan
    hands each step one layer's slice of the kernel and of its adapter alike."""
    if isinstance(layer, nnx.Linear):
        own = 2
    else:
        own = len(tuple(layer.in_features)) + len(tuple(layer.out_features))
    return layer.kernel.ndim - own


def _adaptable(layer: nnx.Module) -> bool:
    """A Linear, or a LinearGeneral that contracts the input's last axes and has no batch axes
    (the adapter contracts the same axes)."""
    if type(layer) in (nnx.Linear, TransposedLinear):
        return True
    if type(layer) is not nnx.LinearGeneral or layer.batch_axis:
        return False
    count = len(layer.in_features)
    return tuple(layer.axis) == tuple(range(-count, 0))


ADAPTED = (nnx.Linear, nnx.LinearGeneral, TransposedLinear)
"""The layers that take adapters: dense layers and attention's projections to and from heads."""


@runtime_checkable
class SelfAdapting(Protocol):
    """A module that adds LoRA adapters to its own kernels (`nnx.LoRAParam`s, starting at an
    exact zero update) and folds them back in. `KERNELS`: the names of those kernels' params,
    each contracted with the input along its last axis and read with `[...]`, which QLoRA holds
    quantized."""

    KERNELS: tuple[str, ...]

    def add_lora(self, rank: int, rngs: nnx.Rngs) -> None: ...

    def merge_lora(self) -> None: ...


def add_adapters(
    model: nnx.Module,
    rank: int,
    layers: str,
    rngs: nnx.Rngs,
    quantize: str | None = None,
    filled: bool = False,
) -> list[str]:
    """Wrap every dense layer (`ADAPTED`) whose path `layers` matches; returns their
    paths. `quantize` (one of `zoo.engine.weights.quantize.FORMATS`): hold each wrapped
    layer's kernel quantized (QLoRA), and each self-adapting module's kernels; `filled`: a checkpoint fills every kernel next (`QuantizedFill`), so
    the model's own initialisation is not quantized. Call it where the model is built (under
    the mesh), so the adapters are born sharded."""
    chosen = [
        (path, module)
        for path, module in nnx.iter_modules(model)
        if path and matches(layers, path) and (_adaptable(module) or _self_adapting(module))
    ]
    if not chosen:
        linears = [dotted(p) for p, m in nnx.iter_modules(model) if isinstance(m, ADAPTED)]
        raise ZooError(
            f"finetune.lora_layers='{layers}' matches none of the model's Linear layers: "
            f"{', '.join(linears) or 'it has none'}."
        )
    for path, module in chosen:
        if _self_adapting(module):
            module.add_lora(rank, rngs)
            if quantize is not None:
                _hold_own_quantized(module, quantize, filled)
        else:
            _replace(model, path, ShardedLoRA(module, rank, rngs, quantize, filled))
    return [dotted(path) for path, _ in chosen]


def _self_adapting(module: nnx.Module) -> bool:
    return isinstance(module, SelfAdapting)


def _hold_own_quantized(module: SelfAdapting, qtype: str, filled: bool) -> None:
    """QLoRA for a module that adapts itself: each of its kernels held quantized in the place
    of its param."""
    for name in module.KERNELS:
        setattr(module, name, quantization.Quantized(getattr(module, name), qtype, filled))


def _put_back_dequantized(module: SelfAdapting) -> None:
    """Each kernel of `module` held quantized back as the param it was, dequantized."""
    for name in module.KERNELS:
        held = getattr(module, name)
        if isinstance(held, quantization.Quantized):
            setattr(module, name, held.param())


def merge_adapters(model: nnx.Module) -> nnx.Module:
    """Fold every adapter into its layer (`kernel + lora_a @ lora_b`, a quantized kernel
    dequantized first) and put the plain layer back in its place; the model then has its
    original structure. In place; returns `model`. Call it under the model's mesh
    (`with result.activate():`)."""
    for _, module in nnx.iter_modules(model):
        if _self_adapting(module):
            _put_back_dequantized(module)
            module.merge_lora()
    adapters = [(p, m) for p, m in nnx.iter_modules(model) if isinstance(m, ShardedLoRA)]
    for path, adapter in adapters:
        layer, merged = adapter.base_module, adapter.merged_kernel()
        if adapter.layout is None:
            layer.kernel[...] = merged
        else:
            with nnx.use_eager_sharding(False):
                layer.kernel = nnx.Param(merged, out_sharding=adapter.kernel_axes)
        _replace(model, path, layer)
    return model


class QuantizedFill:
    """Where a checkpoint's kernel goes in a QLoRA adapter or a quantized kernel of a module
    that adapts itself (`quantize.Quantized`): to a fill it looks like the kernel (its shape,
    dtype, logical axes and sharding), and what the fill sets it quantizes."""

    def __init__(self, adapter: ShardedLoRA | quantization.Quantized):
        self.adapter = adapter
        self.shape, self.dtype = adapter.layout.shape, adapter.layout.dtype

    def get_value(self) -> Any:
        return self.adapter.codes.get_value()  # sharded as the kernel (the same logical axes)

    def get_metadata(self) -> dict[str, Any]:
        return {"out_sharding": self.adapter.kernel_axes}

    def set_value(self, kernel: jax.Array) -> None:
        self.adapter.set_base_kernel(kernel)


def filled(model: nnx.Module, variables: nnx.filterlib.Filter) -> list[tuple[tuple, Any]]:
    """(path, variable) of what a checkpoint fills among the `variables` of a model that may
    hold adapters: a wrapped layer's params under their path without the wrapper's
    `base_module`, a quantized kernel as its `QuantizedFill` under the kernel's path; adapters,
    codes and scales left out."""
    found = [
        (tuple(part for part in path if part != "base_module"), variable)
        for path, variable in nnx.to_flat_state(nnx.state(model, variables))
        if not isinstance(variable, nnx.LoRAParam | quantization.QuantizedKernel)
    ]
    for path, module in nnx.iter_modules(model):
        if isinstance(module, ShardedLoRA) and module.layout is not None:
            found.append(((*path, "kernel"), QuantizedFill(module)))
        elif isinstance(module, quantization.Quantized):
            found.append((path, QuantizedFill(module)))
    return found


def _replace(model: nnx.Module, path: tuple[Any, ...], new: nnx.Module) -> None:
    parent = model
    for part in path[:-1]:
        parent = parent[part] if isinstance(part, int) else getattr(parent, part)
    if isinstance(path[-1], int):
        parent[path[-1]] = new
    else:
        setattr(parent, path[-1], new)


def check_unstacked(finetune: Any, model: Any) -> None:
    """Refuse QLoRA for a model whose layers are stacked for `nnx.scan`
    (`model.scan_layers=true`): a quantized kernel's layout is one layer's (LoRA alone stacks
    its adapters with the layers)."""
    if finetune.quantize is not None and finetune.lora_rank and model.get("scan_layers"):
        raise ZooError(
            f"finetune.quantize={finetune.quantize} holds each adapted layer's kernel quantized, "
            "which zoo does not do for layers stacked for scanning (model.scan_layers=true, one "
            "kernel of every layer's weights): set model.scan_layers=false (the same weights, "
            "the layers one after another), or use LoRA without quantizing "
            "(finetune.quantize=null)."
        )

"""Layers and kernels: the dense layer laid out as checkpoints hold it (`dense`) and the CPU
kernels behind it: XLA:CPU's bfloat16 products (`cpu_dot`) and the compiled few-row kernel of
decoding (`bf16_rows`, built from `bf16_rows.cc`). Model code reaches them through the dense
layer and `zoo.plugin`, never directly."""

from zoo.engine.kernels.cpu_dot import dot_general
from zoo.engine.kernels.dense import TransposedLinear, outputs_first_product

__all__ = [
    "TransposedLinear",
    "dot_general",
    "outputs_first_product",
]

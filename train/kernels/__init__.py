"""Layers and kernels: attention for every model (`attend`, which picks cuDNN's, XLA's, zoo's
CPU kernels of `attention_cpu` or a written-out path by platform and call), the dense layer
laid out as checkpoints hold it (`dense`) and the CPU kernels behind it: XLA:CPU's bfloat16
products (`cpu_dot`) and the compiled few-row kernel of decoding (`bf16_rows`, built from
`bf16_rows.cc`). Model code reaches them through attention, the dense layer and `zoo.plugin`,
never directly."""

from zoo.engine.kernels.attention import attend
from zoo.engine.kernels.cpu_dot import dot_general
from zoo.engine.kernels.dense import TransposedLinear, outputs_first_product
from zoo.engine.kernels.widened import copies as widened_copies
from zoo.engine.kernels.widened import reading as reading_widened

__all__ = [
    "TransposedLinear",
    "attend",
    "dot_general",
    "outputs_first_product",
    "reading_widened",
    "widened_copies",
]

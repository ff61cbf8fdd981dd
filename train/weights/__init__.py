"""Weights: checkpoints of the PyTorch ecosystem read and written (`pretrained`, with
`host_memory`'s page buffers), adapters and quantized bases (`lora`, `quantize`), MXFP4's decoding (`mxfp4`), float32
masters and their average (`master`, `ema`), and which params train (`freeze`, `paths`)."""

from zoo.engine.weights.freeze import Filter
from zoo.engine.weights.host_memory import PAGE, Prefaulted
from zoo.engine.weights.lora import merge_adapters
from zoo.engine.weights.mxfp4 import dequantize_mxfp4, mxfp4_shape
from zoo.engine.weights.pretrained import (
    DTYPES,
    TOKENIZER,
    PlannedFill,
    Pretrained,
    export_tensors,
    is_pretrained,
    open_pretrained,
    plan_fill,
    write_pretrained,
)

__all__ = [
    "DTYPES",
    "PAGE",
    "TOKENIZER",
    "Filter",
    "PlannedFill",
    "Prefaulted",
    "Pretrained",
    "dequantize_mxfp4",
    "export_tensors",
    "is_pretrained",
    "merge_adapters",
    "mxfp4_shape",
    "open_pretrained",
    "plan_fill",
    "write_pretrained",
]

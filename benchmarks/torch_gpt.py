"""zoo's gpt written in PyTorch, and its training loop compiled by `torch.compile`, for
`benchmarks.throughput`. This module imports torch: import it where its absence is handled.

The twin has `zoo.models.gpt`'s architecture: a tied token embedding (rows padded like zoo's),
learned positions, pre-norm blocks (LayerNorm; causal multi-head attention without biases,
its query, key and value projections fused into one matmul, mixed by
`F.scaled_dot_product_attention`, flash attention on GPUs; a tanh-GELU MLP with biases), a final
LayerNorm and the logits through the embedding. Its forward pass returns the loss, the mean
next-token cross-entropy, so `torch.compile` compiles the model and its loss together.
Initialisation is PyTorch's default, embeddings normal(0.02): speed does not depend on it.

`trainer.precision=bf16`'s twin is `torch.autocast(dtype=torch.bfloat16)`: float32 params and
optimizer state, matmuls in bfloat16, norms, softmax and the loss in float32. float32 matmuls
may use TensorFloat-32 on GPUs, as JAX's default precision does there.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from zoo.models.language_model import padded_vocab

from benchmarks.torch_loops import fastest_threads, torch_update


class Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_ratio: int, epsilon: float):
        super().__init__()
        self.num_heads = num_heads
        self.attention_norm = nn.LayerNorm(dim, eps=epsilon)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.LayerNorm(dim, eps=epsilon)
        self.mlp_in = nn.Linear(dim, mlp_ratio * dim)
        self.mlp_out = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.attention_norm(x)).view(b, t, 3, self.num_heads, d // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each batch x heads x length x head_dim
        mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(mixed.transpose(1, 2).reshape(b, t, d))
        h = F.gelu(self.mlp_in(self.mlp_norm(x)), approximate="tanh")
        return x + self.mlp_out(h)


class GPTLoss(nn.Module):
    """The twin of `zoo.models.gpt.GPT` (hparams as zoo resolves them), called on tokens (batch x
    length + 1) for the mean cross-entropy of each position's prediction of the next."""

    def __init__(self, hparams: Mapping[str, Any]):
        super().__init__()
        dim, epsilon = int(hparams["dim"]), float(hparams["norm_epsilon"])
        self.vocab_size = int(hparams["vocab_size"])
        self.embedding = nn.Embedding(padded_vocab(self.vocab_size), dim)
        self.positions = nn.Parameter(torch.empty(int(hparams["context_length"]), dim))
        for table in (self.embedding.weight, self.positions):
            nn.init.normal_(table, std=0.02)
        self.blocks = nn.ModuleList(
            Block(dim, int(hparams["num_heads"]), int(hparams["mlp_ratio"]), epsilon)
            for _ in range(int(hparams["depth"]))
        )
        self.norm = nn.LayerNorm(dim, eps=epsilon)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = self.embedding(inputs) + self.positions[: inputs.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.norm(x), self.embedding.weight)[..., : self.vocab_size]
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def compiled_loop(
    make_model: Callable[[], nn.Module],
    optimizer: Mapping[str, Any],
    tokens: Sequence[np.ndarray],
    precision: str,
    device: str,
) -> Callable[[int], None]:
    """`advance(n)`: n training steps of the compiled twin (`make_model()`, a module whose
    forward pass on a batch of tokens returns the loss) on `device` ("cpu" or "cuda"), cycling
    through `tokens` (host batches, placed on the device once, up front), returning once the
    device has finished them. The optimizer is `optimizer`'s twin, fused."""
    torch.manual_seed(0)
    torch.set_float32_matmul_precision("high")
    model = make_model().to(device).train()
    update = torch_update(model, optimizer, fused=True)
    compiled = torch.compile(model)
    cycle = itertools.cycle([torch.from_numpy(t).to(device, torch.long) for t in tokens])

    def autocast() -> contextlib.AbstractContextManager:
        if precision == "bf16":
            return torch.autocast(device, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def steps(n: int) -> None:
        for _ in range(n):
            with autocast():
                loss = compiled(next(cycle))
            loss.backward()
            update()
        if device == "cuda":
            torch.cuda.synchronize()

    if device == "cuda":
        return steps
    threads = fastest_threads(torch, steps, trial_steps=2)

    def advance(n: int) -> None:
        torch.set_num_threads(threads)
        steps(n)

    return advance

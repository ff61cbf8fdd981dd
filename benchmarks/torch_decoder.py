"""zoo's `decoder` (its default, Llama-style family) written in PyTorch, for
`benchmarks.throughput --decoder`. This module imports torch: import it where its absence is
handled.

The twin has `zoo.models.decoder.Decoder`'s architecture at the hparams zoo resolves: a tied token
embedding (rows padded like zoo's), pre-norm layers (RMSNorm; causal attention with
`num_kv_heads` key/value heads, rotary positions with `rope_theta`, no biases, mixed by
`F.scaled_dot_product_attention`; a SwiGLU MLP `mlp_dim` wide), each projection its own matrix
as in zoo, a final RMSNorm and the logits
through the embedding. Its forward pass returns the mean next-token cross-entropy, so
`torch.compile` compiles the model and its loss together, and it trains in
`benchmarks.torch_gpt.compiled_loop`, as gpt's twin does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from zoo.models.language_model import padded_vocab


def mlp_width(hparams: Mapping[str, Any]) -> int:
    """`mlp_dim`, or (0) the decoder's default: 8/3 of `dim` rounded up to a multiple of 64."""
    return int(hparams["mlp_dim"]) or 64 * -(-8 * int(hparams["dim"]) // (3 * 64))


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, mlp: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.attention_norm = nn.RMSNorm(dim, eps=eps)
        self.q = nn.Linear(dim, heads * head_dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.v = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim, eps=eps)
        self.gate = nn.Linear(dim, mlp, bias=False)
        self.up = nn.Linear(dim, mlp, bias=False)
        self.down = nn.Linear(mlp, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attention_norm(x)
        q = self.q(h).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = (
            p(h).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2) for p in (self.k, self.v)
        )
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        mixed = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads
        )
        x = x + self.o(mixed.transpose(1, 2).reshape(b, t, -1))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class DecoderLoss(nn.Module):
    """The twin of the default `zoo.models.decoder.Decoder` (hparams as zoo resolves them),
    called on tokens (batch x length + 1) for the mean cross-entropy of each next token."""

    def __init__(self, hparams: Mapping[str, Any]):
        super().__init__()
        if not hparams["tie_embeddings"]:
            raise ValueError("the twin has tied embeddings only")
        dim, heads = int(hparams["dim"]), int(hparams["num_heads"])
        kv_heads = int(hparams["num_kv_heads"]) or heads
        head_dim = int(hparams["head_dim"]) or dim // heads
        eps = float(hparams["norm_epsilon"])
        self.vocab_size = int(hparams["vocab_size"])
        self.embedding = nn.Embedding(padded_vocab(self.vocab_size), dim)
        nn.init.normal_(self.embedding.weight, std=0.02)
        self.layers = nn.ModuleList(
            Layer(dim, heads, kv_heads, head_dim, mlp_width(hparams), eps)
            for _ in range(int(hparams["depth"]))
        )
        self.norm = nn.RMSNorm(dim, eps=eps)
        inverse = 1.0 / float(hparams["rope_theta"]) ** (
            torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        )
        angles = torch.arange(int(hparams["context_length"]), dtype=torch.float32)[:, None]
        angles = torch.cat([angles * inverse] * 2, dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        length = inputs.shape[1]
        cos, sin = self.cos[:length], self.sin[:length]
        x = self.embedding(inputs)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = F.linear(self.norm(x), self.embedding.weight)[..., : self.vocab_size]
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

"""`benchmarks.finetune_memory`, which computes a QLoRA fine-tune's memory without allocating a
weight (docs/recipe-qwen3-chat.md's table): its step on the abstract train state needs what the
trainer's own step needs, built and filled from a checkpoint; and it reads the published
architectures as zoo's qwen3 family reads a config."""

from __future__ import annotations

import json

import jax
from helpers import ROOT
from zoo.engine.loop.trainer import Trainer
from zoo.engine.report.memory import step_memory

import zoo
from benchmarks import finetune_memory

QWEN3_CHAT = ROOT / "tests" / "fixtures" / "pretrained" / "qwen3-chat"


def test_the_abstract_step_needs_what_the_trainers_step_needs(tmp_path):
    chats = tmp_path / "chats.jsonl"
    with open(chats, "w") as f:
        for n in range(8):
            messages = [
                {"role": "user", "content": f"What follows {n}?"},
                {"role": "assistant", "content": f"{n + 1}."},
            ]
            f.write(json.dumps({"messages": messages}) + "\n")
    cfg = zoo.compose(
        [
            f"finetune.init_from={QWEN3_CHAT}",
            "data=chat",
            f"data.path={chats}",
            "trainer.batch_size=4",
            "trainer.steps=2",
            f"workdir={tmp_path / 'run'}",
            *finetune_memory.FINETUNE,
        ]
    )
    trainer = Trainer(cfg, jax.devices()[:1])
    batch = next(iter(trainer.train_data))
    shapes = {name: jax.ShapeDtypeStruct(x.shape, x.dtype) for name, x in batch.items()}
    assert finetune_memory.step_memory(cfg, shapes) == step_memory(trainer)


def test_the_published_architecture_holds_its_adapters_and_nf4_kernels():
    """Qwen3-0.6B, 28 layers: adapters of rank 16 in float32 on each projection (q 1024 -> 16
    heads x 128, k and v 1024 -> 8 x 128, o back to 1024, gate and up 1024 -> 3072, down back),
    its kernels as nf4 codes (half a byte a weight) and a bfloat16 scale per 64 weights, the
    tied embedding of 151,936 x 1024 and the RMSNorm scales in bfloat16."""
    cfg = zoo.compose(finetune_memory.overrides("0.6B", batch=8, remat=False))
    sizes = finetune_memory.held(cfg)
    ins_outs = (1024 + 2048) * 2 + (1024 + 1024) * 2 + (1024 + 3072) * 3
    assert sizes["adapters"] == 28 * ins_outs * 16 * 4
    kernels = 28 * (1024 * 2048 * 2 + 1024 * 1024 * 2 + 1024 * 3072 * 3)
    norms = 28 * (1024 + 1024 + 128 + 128) + 1024
    assert sizes["base"] == kernels // 2 + kernels // 64 * 2 + 151936 * 1024 * 2 + norms * 2

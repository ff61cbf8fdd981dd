"""Fine-tuning a mixture-of-experts checkpoint (the tiny Qwen3-MoE fixture, written by
transformers): every param trained, experts and router included; LoRA over the attention
projections with the experts frozen, and over each expert (adapters stacked as the experts'
kernels), merged back into the kernels; the router's load-balancing loss trained with a
preference fine-tune as with the model's own loss; QLoRA over the experts, each projection's
stacked kernel held quantized (codes and scales, checkpointed) under adapters trained on top,
merged and exported as the dequantized kernel plus B A; and chat fine-tuning and reward
fine-tuning as dense chat checkpoints take them: conversations trained on their replies alone,
and GRPO sampling its completions from the mixture, each logging the router's scalars. Mixtral
in full and under LoRA and QLoRA, and gpt-oss in full, as well (DeepSeek V3:
test_finetune_deepseek.py; gpt-oss's MXFP4 experts under QLoRA: test_finetune_mxfp4.py)."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pytest
from flax import nnx
from helpers import (
    ROOT,
    TINY_TEXT_FINETUNE,
    TWO_LOGGED_STEPS,
    read_events,
    scalar_steps,
    write_jsonl,
)
from PIL import Image
from zoo.engine.weights.quantize import Quantized, quantize
from zoo.models.experts import PROJECTIONS

import zoo
from zoo.plugin import LOSS_MASK

CHECKPOINT = ROOT / "tests" / "fixtures" / "pretrained" / "qwen3-moe-tiny"
ATTENTION = r"layers\.\d+\.attention"
TEMPLATE = ROOT / "tests" / "fixtures" / "chat_templates" / "chatml-generation"
"""The fixture has no chat template: the conversations, pairs and prompts are rendered with this
ChatML one (its replies marked with `{% generation %}`)."""
ROUTED = ("router_aux_loss", *(f"expert_load/layers.{i}.mlp" for i in (1, 2)))
"""The router's scalars TensorBoard shows for the fixture's two mixture layers."""
POST_TRAINING = (
    *TWO_LOGGED_STEPS,
    "logging.norms_every=0",  # no norms at the first step: a gradient's compilation less
    f"data.template={TEMPLATE}",
    "model.router_aux_loss_coef=0.01",
)
"""Two steps of a chat or reward fine-tune, each logged, an eval after the second."""


def params(model: nnx.Module) -> dict[str, np.ndarray]:
    """Dotted path -> value of every param, LoRA wrappers' `base_module` left out of the path."""
    return {
        ".".join(str(p) for p in path if p != "base_module"): np.asarray(v[...])
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


@pytest.fixture(scope="module")
def pretrained():
    return params(zoo.load(CHECKPOINT).model)


def test_a_full_fine_tune_trains_the_experts_and_the_router(pretrained, tmp_path):
    """With the router's load-balancing loss (as output_router_logits=true gives it), which
    TensorBoard shows beside each mixture layer's load, in training and at each eval."""
    result = zoo.finetune(
        CHECKPOINT,
        *TINY_TEXT_FINETUNE,
        "model.router_aux_loss_coef=0.01",
        "logging.eval_reports=true",  # the expert load's picture and table
        f"workdir={tmp_path}",
    )
    events = read_events(tmp_path)
    tags = set(events.Tags()["scalars"])
    for split in ("train", "val"):
        routed = {
            f"{split}/router_aux_loss",
            *(f"{split}/expert_load/layers.{i}.mlp" for i in (1, 2)),
        }
        assert routed <= tags, sorted(tags)
    assert result.eval_metrics["router_aux_loss"] >= 2.0  # experts_per_token: an even routing
    (picture,) = events.Images("visuals/expert_load")[-1:]
    image = np.asarray(Image.open(io.BytesIO(picture.encoded_image_string)))
    assert image.shape[0] > 2 * 12 and image.shape[1] > 4 * 2  # two layers' rows, four experts
    (table,) = events.Tensors("visuals/expert_load/text_summary")[-1:]
    rows = table.tensor_proto.string_val[0].decode().splitlines()
    assert [row.split(" | ")[0] for row in rows[2:]] == ["| layers.1.mlp", "| layers.2.mlp"]
    # each layer's counts: every eval token (and pad-free) picks experts_per_token=2 experts
    totals = {sum(map(int, row.strip("| ").split(" | ")[1:])) for row in rows[2:]}
    assert len(totals) == 1 and totals.pop() % 2 == 0
    tuned = params(result.model)
    for path in (
        "layers.1.mlp.experts.gate",
        "layers.2.mlp.router.kernel",
        "layers.0.mlp.up.kernel",
    ):
        assert not np.array_equal(tuned[path], pretrained[path]), path
    assert np.isfinite(result.eval_metrics["loss"])


def test_lora_on_the_attention_leaves_the_experts_as_they_were(pretrained, tmp_path):
    result = zoo.finetune(
        CHECKPOINT, *TINY_TEXT_FINETUNE, f"workdir={tmp_path}", lora_rank=4, lora_layers=ATTENTION
    )
    adapted = {
        ".".join(map(str, path))
        for path, _ in nnx.to_flat_state(nnx.state(result.model, nnx.LoRAParam))
    }
    assert "layers.1.attention.query.lora_a" in adapted
    assert not any(".mlp." in path for path in adapted)
    tuned = params(result.model)
    for path, value in pretrained.items():
        np.testing.assert_array_equal(tuned[path], value, err_msg=path)


@pytest.mark.parametrize(
    "mesh",
    [
        ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"),
        ("mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2"),
    ],
    ids=["2x2x2", "expert2-fsdp2-tensor2"],
)
def test_lora_on_the_experts_adapts_each_expert_and_merges_into_its_kernels(
    pretrained, mesh, tmp_path
):
    """The default `lora_layers` (every layer) adapts each expert's three projections, stacked
    as the kernels are, on the 2x2x2 mesh (each expert's hidden width split over `tensor`) and
    on a mesh that splits the experts too (adapters split with their experts); the kernels and
    the router stay frozen; merged, each expert's kernel is kernel + B A, and the merged model
    computes what the adapted one does."""
    result = zoo.finetune(
        CHECKPOINT, *TINY_TEXT_FINETUNE, *mesh, f"workdir={tmp_path}", lora_rank=4
    )
    adapters = {
        ".".join(map(str, path)): np.asarray(v[...])
        for path, v in nnx.to_flat_state(nnx.state(result.model, nnx.LoRAParam))
    }
    gate_a, gate_b = (adapters[f"layers.1.mlp.experts.gate_lora_{part}"] for part in "ab")
    experts, hidden, dim = pretrained["layers.1.mlp.experts.gate"].shape
    assert gate_a.shape == (experts, 4, dim) and gate_b.shape == (experts, hidden, 4)
    assert np.abs(gate_b).max() > 0  # trained from zero
    assert "layers.0.mlp.up.lora_a" in adapters  # the dense first layer's MLP, as ever
    tuned = params(result.model)
    for path, value in pretrained.items():
        np.testing.assert_array_equal(tuned[path], value, err_msg=path)
    merged = zoo.merge_lora(result)
    folded = params(merged.model)["layers.1.mlp.experts.gate"]
    expected = pretrained["layers.1.mlp.experts.gate"] + np.einsum("eor,eri->eoi", gate_b, gate_a)
    np.testing.assert_allclose(folded, expected, rtol=1e-6, atol=1e-6)
    assert not nnx.state(merged.model, nnx.LoRAParam)
    prompt = np.arange(1, 17, dtype=np.int32)[None]
    np.testing.assert_allclose(
        zoo.predict(merged, prompt), zoo.predict(result, prompt), rtol=1e-4, atol=1e-4
    )


@pytest.fixture(scope="module")
def qlora(tmp_path_factory):
    """A QLoRA (nf4) fine-tune over every layer of the fixture on a mesh that splits the experts
    (expert=2), their hidden width (tensor=2) and the rest (fsdp=2), and its workdir."""
    workdir = tmp_path_factory.mktemp("qlora")
    mesh = ("mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2")
    result = zoo.finetune(
        CHECKPOINT, *TINY_TEXT_FINETUNE, *mesh, f"workdir={workdir}", lora_rank=4, quantize="nf4"
    )
    return result, workdir


def held(model: nnx.Module) -> dict[str, Quantized]:
    """Dotted path -> each expert kernel held quantized."""
    return {
        ".".join(map(str, path)): module
        for path, module in nnx.iter_modules(model)
        if isinstance(module, Quantized)
    }


def test_qlora_holds_each_expert_s_kernel_quantized_under_trained_adapters(pretrained, qlora):
    """Each projection's stacked kernel is held as nf4 codes (two a byte) and scales, the
    checkpoint's kernel quantized bit for bit after the fine-tune (frozen), split with the
    experts and their hidden width; no float copy is kept; the adapters trained on top."""
    result, _ = qlora
    kernels = held(result.model)
    projections = [f"layers.{i}.mlp.experts.{name}" for i in (1, 2) for name in PROJECTIONS]
    assert sorted(kernels) == sorted(projections)
    tuned = params(result.model)
    for path, kernel in kernels.items():
        assert path not in tuned  # no float kernel
        codes, scale = quantize(pretrained[path], kernel.layout)
        experts, out, inputs = pretrained[path].shape
        assert kernel.codes[...].shape == (experts, out, inputs // 2)
        np.testing.assert_array_equal(np.asarray(kernel.codes[...]), np.asarray(codes), path)
        np.testing.assert_array_equal(np.asarray(kernel.scale[...]), np.asarray(scale), path)
        assert kernel.codes[...].sharding.spec[0] == "expert", path
    adapters = dict(nnx.to_flat_state(nnx.state(result.model, nnx.LoRAParam)))
    assert (
        np.abs(np.asarray(adapters[("layers", 1, "mlp", "experts", "down_lora_b")][...])).max() > 0
    )
    kept = pretrained.keys() & tuned.keys()  # not held quantized: the router, norms, embedding
    assert {"layers.1.mlp.router.kernel", "embedding"} <= kept
    for path in kept:
        np.testing.assert_array_equal(tuned[path], pretrained[path], err_msg=path)


def test_qlora_on_the_experts_merges_and_exports_the_dequantized_kernel_plus_b_a(qlora, tmp_path):
    """Reloaded from its workdir (codes, scales and adapters restored), the run merges each
    expert's adapter into its dequantized kernel, computes what the adapted model does, and
    exports those kernels."""
    _, workdir = qlora
    loaded = zoo.load(workdir)
    with loaded.activate():
        expected = {}
        for path, kernel in held(loaded.model).items():
            experts = loaded.model
            for part in path.split(".")[:-1]:
                experts = experts[int(part)] if part.isdigit() else getattr(experts, part)
            name = path.rsplit(".", 1)[1]
            a, b = (np.asarray(getattr(experts, f"{name}_lora_{x}")[...]) for x in "ab")
            expected[path] = np.asarray(kernel[...]) + np.einsum("eor,eri->eoi", b, a)
    assert len(expected) == 6
    merged = zoo.merge_lora(loaded)
    folded = params(merged.model)
    for path, kernel in expected.items():
        np.testing.assert_allclose(folded[path], kernel, rtol=1e-6, atol=1e-6, err_msg=path)
    assert not held(merged.model) and not nnx.state(merged.model, nnx.LoRAParam)
    prompt = np.arange(1, 17, dtype=np.int32)[None]
    np.testing.assert_allclose(
        zoo.predict(merged, prompt), zoo.predict(loaded, prompt), rtol=1e-4, atol=1e-4
    )
    exported = params(zoo.load(zoo.export(workdir, tmp_path / "hf", format="hf")).model)
    for path, kernel in expected.items():
        np.testing.assert_allclose(exported[path], kernel, rtol=1e-6, atol=1e-6, err_msg=path)


def test_dpo_trains_with_the_router_loss_and_reports_the_routing(tmp_path):
    """A preference fine-tune of a mixture adds its router's load-balancing loss, over every
    token of both sequences of each pair, as the model's own loss does: with LoRA the policy is
    the reference at the first step, so that step's loss is log 2 plus the weighted router
    loss; TensorBoard shows the router loss and each layer's load, in training and at eval."""
    pairs = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"say {i}", "chosen": "YES", "rejected": "no"} for i in range(32)]
    pairs.write_text("".join(json.dumps(row) + "\n" for row in rows))
    workdir = tmp_path / "run"
    zoo.finetune(
        CHECKPOINT,
        *TWO_LOGGED_STEPS,
        f"data.template={TEMPLATE}",
        "model.router_aux_loss_coef=0.5",
        f"workdir={workdir}",
        data=pairs,
        method="dpo",
        lora_rank=4,
    )
    events = read_events(workdir)
    first = {tag: events.Scalars(tag)[0].value for tag in ("train/loss", "train/router_aux_loss")}
    assert first["train/router_aux_loss"] >= 2.0  # experts_per_token: an even routing
    np.testing.assert_allclose(
        first["train/loss"], math.log(2) + 0.5 * first["train/router_aux_loss"], rtol=1e-5
    )
    tags = set(events.Tags()["scalars"])
    for split in ("train", "val"):
        assert {f"{split}/expert_load/layers.{i}.mlp" for i in (1, 2)} <= tags, sorted(tags)


@pytest.mark.parametrize(
    ("family", "how"),
    [
        ("mixtral-tiny", "full"),
        ("mixtral-tiny", "lora"),
        ("mixtral-tiny", "qlora"),
        ("gpt-oss-tiny", "full"),
    ],
)
def test_each_family_fine_tunes_its_experts(family, how, tmp_path):
    """Mixtral's experts (`block_sparse_moe`) in full and under LoRA and QLoRA, gpt-oss's
    (biased, with its clamped SwiGLU and biased router) in full, as Qwen3-MoE's above: a full fine-tune moves
    every expert's kernels and biases and the router; LoRA and QLoRA train adapters stacked as
    each expert's kernel over the frozen (QLoRA: held quantized) kernels, and the merged model
    computes what the adapted one does."""
    checkpoint = CHECKPOINT.parent / family
    before = params(zoo.load(checkpoint).model)
    options = {"full": {}, "lora": {"lora_rank": 4}, "qlora": {"lora_rank": 4, "quantize": "nf4"}}
    result = zoo.finetune(checkpoint, *TINY_TEXT_FINETUNE, f"workdir={tmp_path}", **options[how])
    tuned = params(result.model)
    experts = [p for p in before if ".mlp.experts." in p or ".mlp.router." in p]
    # Mixtral: 2 layers of 3 kernels and a router; gpt-oss: 3 layers of 3 biased kernels and a
    # biased router
    assert len(experts) == {"mixtral-tiny": 2 * 4, "gpt-oss-tiny": 3 * 8}[family]
    if how == "full":
        for path in experts:
            assert not np.array_equal(tuned[path], before[path]), path
        return
    quantized = held(result.model)
    kernels = [f"layers.{i}.mlp.experts.{name}" for i in (0, 1) for name in PROJECTIONS]
    assert sorted(quantized) == (sorted(kernels) if how == "qlora" else [])
    for path in set(experts) - set(quantized):
        np.testing.assert_array_equal(tuned[path], before[path], err_msg=path)
    adapters = dict(nnx.to_flat_state(nnx.state(result.model, nnx.LoRAParam)))
    up_b = np.asarray(adapters[("layers", 1, "mlp", "experts", "up_lora_b")][...])
    assert up_b.shape == (4, 24, 4) and np.abs(up_b).max() > 0  # per expert, trained from zero
    merged = zoo.merge_lora(result)
    assert not held(merged.model) and not nnx.state(merged.model, nnx.LoRAParam)
    prompt = np.arange(1, 17, dtype=np.int32)[None]
    np.testing.assert_allclose(
        zoo.predict(merged, prompt), zoo.predict(result, prompt), rtol=1e-4, atol=1e-4
    )


def test_a_chat_fine_tune_trains_on_the_replies_alone_and_reports_the_routing(tmp_path):
    """Conversations (`data=chat`) fine-tune a mixture under LoRA as they do a dense chat
    checkpoint: the loss is over the replies' tokens alone (the held-out loss counts the mask's
    tokens, each row's being its reply and end of turn), the experts' adapters train, and the
    router's loss and each layer's load are logged at every step and at the eval."""
    replies = {f"{n}+1?": f"{n + 1}" for n in range(16)}  # the tokenizer's ChatML: ~60 tokens
    chat = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in replies.items()
        ],
    )
    workdir = tmp_path / "run"
    result = zoo.finetune(
        CHECKPOINT,
        *POST_TRAINING,
        "data=chat",
        f"data.path={chat}",
        "data.eval_fraction=0.25",
        "data.eval_replies=0",
        f"workdir={workdir}",
        lora_rank=4,
    )
    assert result.config.data.loss_on == "assistant"
    data = {k: v for k, v in result.config.data.items() if k != "name"}
    splits = zoo.load_data("chat", **data)
    held_out = splits.eval.examples(np.arange(len(splits.eval)), None, 0)
    targets, mask = held_out["tokens"][:, 1:], held_out[LOSS_MASK].astype(bool)
    trained = [
        splits.tokenizer.decode(t[m].tolist(), skip_special_tokens=False)
        for t, m in zip(targets, mask, strict=True)
    ]
    assert trained and all(text.removesuffix("<|im_end|>") in replies.values() for text in trained)
    assert all(text.endswith("<|im_end|>") for text in trained), trained
    assert result.eval_metrics["loss_tokens"] == mask.sum()
    events = read_events(workdir)
    for name in ROUTED:
        assert sorted(scalar_steps(events, f"train/{name}")) == [1, 2], name
        assert sorted(scalar_steps(events, f"val/{name}")) == [2], name
    assert result.eval_metrics["router_aux_loss"] >= 2.0  # experts_per_token: an even routing
    adapters = dict(nnx.to_flat_state(nnx.state(result.model, nnx.LoRAParam)))
    for i in (1, 2):
        up_b = np.asarray(adapters[("layers", i, "mlp", "experts", "up_lora_b")][...])
        assert np.abs(up_b).max() > 0, i  # trained from zero


def test_grpo_samples_from_a_mixture_and_trains_its_experts(tmp_path):
    """A reward fine-tune of a mixture: each step samples completions of its prompts from the
    mixture (the KV-cache engine routes each new token as training does), rewards them and
    trains the experts' adapters on their advantages; TensorBoard has the reward and the
    router's scalars at every step and at the eval. The last mixture layer's experts feed no
    router, so their adapters move only by the reward's loss."""
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"Say {i}."} for i in range(20)])
    workdir = tmp_path / "run"
    result = zoo.finetune(
        CHECKPOINT,
        *POST_TRAINING,
        "finetune.grpo.rewards=[tests.fixtures.posttraining.toy_rewards:vowels]",
        "finetune.grpo.num_generations=2",  # of each of the batch's 8 prompts
        "finetune.grpo.max_completion_length=4",
        "data.eval_fraction=0.1",
        "data.eval_replies=0",
        "optimizer.learning_rate=1e-2",
        f"workdir={workdir}",
        data=prompts,
        method="grpo",
        lora_rank=4,
    )
    assert result.step == 2
    events = read_events(workdir)
    for name in ("reward", "rewards/vowels/mean", "completions/mean_length", *ROUTED):
        assert sorted(scalar_steps(events, f"train/{name}")) == [1, 2], name
        assert sorted(scalar_steps(events, f"val/{name}")) == [2], name
    assert all(v > 0 for v in scalar_steps(events, "train/completions/mean_length").values())
    assert all(v > 0 for v in scalar_steps(events, "train/advantages/std").values())
    adapters = dict(nnx.to_flat_state(nnx.state(result.model, nnx.LoRAParam)))
    down_b = np.asarray(adapters[("layers", 2, "mlp", "experts", "down_lora_b")][...])
    assert np.abs(down_b).max() > 0  # trained from zero

"""Fine-tuning through the Python API, on real runs: models trained by the CLI in a subprocess
(one of them fully sharded, fsdp=8), loaded from their Orbax checkpoints, fine-tuned through
the trainer on user data (numpy columns and a Grain MapDataset) with a new head, a frozen
backbone or LoRA adapters, on another mesh; TensorBoard events read back."""

from __future__ import annotations

import logging
import re

import grain
import jax
import numpy as np
import pytest
from flax import nnx
from helpers import assert_same_bits, read_events, run_cli, scalar_steps
from zoo.engine.weights.lora import ShardedLoRA

import zoo

COMMON = ("data=digits", "trainer.batch_size=64", "optimizer.warmup_steps=0")
CNN = ("model=cnn", "model.channels=[8,16,16]", *COMMON)
MLP = ("model=mlp", "model.hidden_sizes=[32,32,32]", "mesh.data=1", "mesh.fsdp=8", *COMMON)
TUNE = ("trainer.batch_size=64", "optimizer.warmup_steps=0", "optimizer.schedule=constant")


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """Workdirs of two runs of the CLI on digits: a small cnn, and a small mlp on an fsdp=8 mesh."""
    runs = {}
    for name, args in (("cnn", CNN), ("mlp", MLP)):
        workdir = tmp_path_factory.mktemp(name)
        every = ("trainer.eval_every=30", "trainer.checkpoint_every=30")
        devices = 8 if name == "mlp" else 1
        result = run_cli(*args, "trainer.steps=60", *every, f"workdir={workdir}", devices=devices)
        assert result.returncode == 0, result.stderr
        runs[name] = workdir
    return runs


def five_classes() -> zoo.Splits:
    """The user's own data: digits 0-4, training split as a Grain MapDataset of records."""
    digits = zoo.load_data("digits")
    train = {k: v[digits.train["label"] < 5] for k, v in digits.train.items()}
    records = [{k: v[i] for k, v in train.items()} for i in range(len(train["label"]))]
    evaluate = {k: v[digits.eval["label"] < 5] for k, v in digits.eval.items()}
    return zoo.Splits(grain.MapDataset.source(records), evaluate, transform=digits.transform)


def flat(state: nnx.State) -> dict[str, jax.Array]:
    return {".".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(state)}


def test_a_cli_run_loads_ready_to_call(cli_runs):
    loaded = zoo.load(cli_runs["cnn"])
    assert loaded.step == 60 and loaded.config.model.channels == [8, 16, 16]
    assert loaded.model.blocks[0].norm.use_running_average  # eval mode
    digits = zoo.load_data("digits")
    metrics = zoo.evaluate(loaded, digits)
    assert metrics["accuracy"] == pytest.approx(loaded.eval_metrics["accuracy"], abs=1e-6)
    assert metrics["accuracy"] > 0.5, metrics
    logits = zoo.predict(loaded, digits.transform({"image": digits.eval["image"]})["image"])
    assert logits.shape == (360, 10)
    assert np.mean(logits.argmax(-1) == digits.eval["label"]) == pytest.approx(
        metrics["accuracy"], abs=1e-9
    )
    assert zoo.load(cli_runs["cnn"], "30").step == 30
    assert zoo.load(cli_runs["cnn"], "best").step in (30, 60)


def test_a_loaded_run_is_restored_into_an_abstract_model_with_no_init_compiled(
    cli_runs, caplog, fresh_compiles
):
    with jax.log_compiles(True), caplog.at_level(logging.WARNING, logger="jax"):
        loaded = zoo.load(cli_runs["mlp"], mesh={"data": 2, "fsdp": 4})
    compiled = [
        r.getMessage() for r in caplog.records if "Finished XLA compilation" in r.getMessage()
    ]
    assert compiled and not [line for line in compiled if "jit(create)" in line], compiled
    kernel = loaded.model.hidden[0].kernel[...]
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
    np.testing.assert_array_equal(kernel, zoo.load(cli_runs["mlp"]).model.hidden[0].kernel[...])


def test_missing_runs_and_steps_are_named(cli_runs, tmp_path):
    looked_for = re.escape(f"looked for {tmp_path}/checkpoints/<step>/, but it is empty")
    with pytest.raises(zoo.ZooError, match=looked_for):
        zoo.load(tmp_path)
    with pytest.raises(zoo.ZooError, match="No checkpoint at step 7 .* saved steps: 30, 60"):
        zoo.load(cli_runs["cnn"], 7)


def test_a_new_head_needs_the_explicit_option_naming_the_params(cli_runs, tmp_path):
    with pytest.raises(zoo.ZooError) as error:
        zoo.finetune(
            cli_runs["cnn"], *TUNE, f"workdir={tmp_path}", data=five_classes(), num_classes=5
        )
    message = str(error.value)
    assert "head.kernel (checkpoint (64, 10), model (64, 5))" in message, message
    assert "head.bias (checkpoint (10,), model (5,))" in message, message
    assert "e.g. replace_head=True" in message and "\n" not in message  # Python's name


@pytest.fixture(scope="module")
def head_tuned(cli_runs, tmp_path_factory):
    """The cnn fine-tuned on the user's five classes: new head, frozen backbone, 40 steps."""
    workdir = tmp_path_factory.mktemp("head")
    args = (*TUNE, "trainer.steps=40", "trainer.log_every=10", "trainer.checkpoint_every=20")
    options = {"data": five_classes(), "num_classes": 5, "replace_head": True, "freeze": "backbone"}
    return zoo.finetune(cli_runs["cnn"], *args, f"workdir={workdir}", **options), args, options


def test_frozen_backbone_is_bit_unchanged_and_has_no_optimizer_state(cli_runs, head_tuned):
    result, _, _ = head_tuned
    base = flat(nnx.state(zoo.load(cli_runs["cnn"]).model, nnx.Not(nnx.RngState)))
    tuned = flat(nnx.state(result.model, nnx.Not(nnx.RngState)))
    backbone = [name for name in base if not name.startswith("head.")]
    assert any(".norm.mean" in name for name in backbone)  # BatchNorm statistics too
    for name in backbone:
        np.testing.assert_array_equal(np.asarray(tuned[name]), np.asarray(base[name]), name)
    # Optimizer leaves: ('opt_state', <transform>, 'mu' or 'nu', *param path), counters.
    paths = [p for p, _ in nnx.to_flat_state(result.state[1])]
    optimized = {".".join(map(str, p[3:])) for p in paths if len(p) > 3}
    assert optimized == {"head.kernel", "head.bias"}, paths


def test_the_new_head_trains_and_the_run_is_a_zoo_run(head_tuned):
    result, _, _ = head_tuned
    assert result.model.head.kernel.shape == (64, 5)
    losses = scalar_steps(read_events(result.workdir), "train/loss")
    assert sorted(losses) == [10, 20, 30, 40]
    assert losses[40] < 0.8 * losses[10], losses
    assert result.eval_metrics["accuracy"] > 0.6, result.eval_metrics  # chance: 0.2
    loaded = zoo.load(result.workdir)
    assert loaded.config.data.name == "user" and loaded.config.finetune.freeze == "backbone"
    assert zoo.evaluate(loaded, five_classes()) == pytest.approx(result.eval_metrics, abs=1e-6)


def test_the_same_call_again_resumes_to_the_same_bits(cli_runs, head_tuned, tmp_path):
    result, args, options = head_tuned
    shorter = [a.replace("trainer.steps=40", "trainer.steps=20") for a in args]
    first = zoo.finetune(cli_runs["cnn"], *shorter, f"workdir={tmp_path}", **options)
    again = zoo.finetune(cli_runs["cnn"], *args, f"workdir={tmp_path}", **options)
    assert (first.step, again.start_step, again.step) == (20, 20, 40)
    assert_same_bits(again.state, result.state)
    with pytest.raises(zoo.ZooError, match="finetune.freeze: backbone -> blocks"):
        zoo.finetune(
            cli_runs["cnn"], *args, f"workdir={tmp_path}", **{**options, "freeze": "blocks"}
        )


def test_lora_on_another_mesh_trains_only_adapters_and_merges(cli_runs, tmp_path):
    """From the fsdp=8 mlp run, on a data=2 fsdp=2 tensor=2 mesh: LoRA on the hidden layers."""
    base = zoo.load(cli_runs["mlp"], mesh={"data": 1, "fsdp": 8})
    kernel = base.model.hidden[0].kernel[...]
    assert jax.typeof(kernel).sharding.spec == jax.P("fsdp", "tensor")
    assert len(kernel.sharding.device_set) == 8  # split 8 ways, as it was trained
    mesh = ("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2")
    result = zoo.finetune(
        base,
        *TUNE,
        *mesh,
        "trainer.steps=30",
        "optimizer.learning_rate=0.01",
        f"workdir={tmp_path}",
        lora_rank=4,
        lora_layers="hidden",
    )
    adapters = flat(nnx.state(result.model, nnx.LoRAParam))
    assert len(adapters) == 6 and all(
        np.any(np.asarray(b) != 0) for n, b in adapters.items() if n.endswith("lora_b")
    )
    kernel = result.model.hidden[0].base_module.kernel[...]
    assert dict(kernel.sharding.mesh.shape) == {"data": 2, "fsdp": 2, "expert": 1, "tensor": 2}
    assert jax.typeof(kernel).sharding.spec == jax.P("fsdp", "tensor")  # the new mesh's plan
    lora_a = result.model.hidden[0].lora_a[...]
    assert jax.typeof(lora_a).sharding.spec == jax.P("fsdp", None)  # born sharded
    before = flat(nnx.state(base.model, nnx.Param))
    after = flat(nnx.state(result.model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))
    assert {n.replace(".base_module", "") for n in after} == set(before)
    for name, value in after.items():
        np.testing.assert_array_equal(value, before[name.replace(".base_module", "")], name)
    optimizer = {p[-1] for p, _ in nnx.to_flat_state(result.state[1]) if len(p) > 3}
    assert optimizer == {"lora_a", "lora_b"}, optimizer

    digits = zoo.load_data("digits")
    images = digits.transform({"image": digits.eval["image"][:50]})["image"]
    adapted = zoo.predict(result, images)
    assert not np.allclose(adapted, zoo.predict(base, images), atol=1e-3)
    merged = zoo.merge_lora(result)  # a copy: `result` keeps its adapters
    assert not any(isinstance(m, ShardedLoRA) for _, m in nnx.iter_modules(merged.model))
    assert any(isinstance(m, ShardedLoRA) for _, m in nnx.iter_modules(result.model))
    assert set(flat(nnx.state(merged.model, nnx.Param))) == set(before)
    np.testing.assert_allclose(zoo.predict(merged, images), adapted, rtol=1e-4, atol=1e-5)


def test_freezing_by_nnx_filter(cli_runs, tmp_path):
    blocks = nnx.All(nnx.Param, nnx.PathContains("blocks"))
    result = zoo.finetune(
        cli_runs["cnn"], *TUNE, "trainer.steps=5", f"workdir={tmp_path}", freeze=blocks
    )
    base = flat(nnx.state(zoo.load(cli_runs["cnn"]).model, nnx.Param))
    tuned = flat(nnx.state(result.model, nnx.Param))
    changed = {name for name in base if np.any(np.asarray(tuned[name]) != np.asarray(base[name]))}
    assert changed == {"head.kernel", "head.bias"}, changed
    assert result.config.finetune.freeze == repr(blocks)

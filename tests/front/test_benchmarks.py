"""The benchmark entry points run end to end and write the JSON their readers expect."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import NO_COMPILE_CACHE, ROOT
from zoo.engine import registry

from benchmarks import device_check, experts, grpo_step, serving, throughput
from benchmarks.state_hashes import state_hash


def test_benchmark_runs_and_writes_every_figure(tmp_path):
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "benchmarks.run", "--models", "xor", "--windows", "2"]
    command += ["--window-seconds", "0.01", "--steps-per-dispatch", "10", "--json", str(out)]
    command += ["trainer.log_every=10"]
    env = {**os.environ, **NO_COMPILE_CACHE}
    subprocess.run(command, cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())["models"]["xor"]
    for loop in ("zoo", "zoo_dispatch", "bare", "nnx"):
        figures = result["steps_per_sec"][loop]
        assert 0 < figures["min"] <= figures["median"] <= figures["max"]
        assert len(result["per_window"][loop]) == 2
    assert set(result["ratios"]) >= {"zoo/bare", "zoo_dispatch/bare", "zoo/nnx"}
    assert result["compilations"]["train_step"] == 1
    assert result["pipeline_batches_per_sec"] > 0
    for loop in ("zoo", "zoo_dispatch"):  # read back from the trainers' TensorBoard events
        share = result["data_wait_share"][loop]
        assert 0 <= share["min"] <= share["median"] <= share["max"] < 1
    assert "torch" in result["steps_per_sec"] or result["not_measured"]["torch"]


def test_the_serving_benchmark_writes_every_figure_of_its_table(tmp_path):
    """At tiny settings (a server of two rows of 64 slots, two requests of four tokens): each
    row of docs/serving.md's table, with its figures, in the JSON and the table printed."""
    out = tmp_path / "serving.json"
    sizes = ["--requests", "2", "--max-tokens", "4", "--rows", "2", "--max-length", "64"]
    report = serving.main([*sizes, "--clients", "1", "2", "--json", str(out)])
    assert json.loads(out.read_text()) == report
    assert list(report["rows"]) == [
        "zoo.serve, 1 client",
        "zoo.serve, 2 clients",
        "zoo.generate, one batch",
        "zoo.generate, one at a time",
    ]
    for row in report["rows"].values():
        assert row["tokens"] > 0 and row["tokens_per_s"] > 0
        assert 0 < row["ttft_p50_s"] <= row["ttft_p95_s"]
    assert len(serving.table(report).splitlines()) == 2 + len(report["rows"])


def test_throughput_measures_zoo_alone_without_torch(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # importing it fails: as if not installed
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # restored afterwards
    out = tmp_path / "throughput.json"
    sizes = ["--depth", "1", "--dim", "32", "--heads", "2", "--context", "16", "--batch", "4"]
    report = throughput.main(
        ["--small", *sizes, "--rounds", "2", "--steps", "2", "--json", str(out)]
    )
    assert json.loads(out.read_text()) == report
    assert "PyTorch is not installed" in report["not_measured"]["torch"]
    assert set(report["loops"]) == {"zoo fp32", "zoo bf16"} and report["ratios"] == {}
    assert report["compilations"] == {"fp32": 1, "bf16": 1}
    assert report["peak_source"] == "measured float32 matmul"
    for loop in report["loops"].values():
        for figure in ("tokens_per_sec", "mfu"):
            assert 0 < loop[figure]["min"] <= loop[figure]["median"] <= loop[figure]["max"]
        assert len(loop["per_round_seconds"]) == 2
    # 6 N + 12 L T d, N counted from the sizes: the embedding (256 rows x 32), one block
    # (two norms, four 32 x 32 projections, the MLP 32 -> 128 -> 32 with biases), the final norm.
    block = 2 * 2 * 32 + 4 * 32 * 32 + (32 * 128 + 128) + (128 * 32 + 32)
    params = 256 * 32 + block + 2 * 32
    assert report["flops_per_token"] == 6 * params + 12 * 1 * 16 * 32


def test_grpo_step_splits_a_step_and_sets_its_sampling_beside_decoding(tmp_path):
    """`--tiny`: one timed GRPO step of the tiny Qwen3 chat fixture, its phases, its sampling
    rate beside a decoding `Session`'s on the same batch, its peak memory."""
    out = tmp_path / "grpo_step.json"
    argv = ["--tiny", "--repeats", "1", "--completion-tokens", "8", "--json", str(out)]
    report = grpo_step.main(argv)
    assert json.loads(out.read_text()) == report
    assert (report["prompts"], report["generations"], report["lora_rank"]) == (2, 4, 16)
    seconds, (measured,) = report["seconds"], report["rounds"]
    assert all(seconds[phase] == measured[phase] > 0 for phase in grpo_step.PHASES)
    assert seconds["step"] == pytest.approx(sum(seconds[p] for p in grpo_step.PHASES))
    assert sum(report["share"].values()) == pytest.approx(1)
    assert 0 < report["tokens_written"] <= 2 * 4 * 8
    rate = report["tokens_written"] / seconds["rollout"]
    assert report["rollout_tokens_per_s"] == pytest.approx(rate)
    assert set(report["decode"]) == {
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
        "call_tokens_per_s",
    }
    assert all(value > 0 for value in report["decode"].values())
    assert report["rollout_x_decode"] == pytest.approx(
        rate / report["decode"]["decode_tokens_per_s"]
    )
    bucket = 128  # data=prompts' smallest bucket holds the prompts
    assert len(report["prompt_tokens"]) == 2 and max(report["prompt_tokens"]) <= bucket
    # the rows train on the longest prompt and 8 completion tokens, to a power of two
    longest = max(report["prompt_tokens"]) + 8
    assert longest <= report["train_width"] < 2 * longest
    for peak in report["memory"].values():
        assert peak["rss_peak_bytes"] > 0 and peak["device_peak_bytes"] is None  # XLA:CPU
    assert "| rollout / decode |" in grpo_step.table(report)


def test_device_check_runs_every_section_on_small_shapes(tmp_path, monkeypatch):
    """`--small` on a CPU: one model's run, GPT-2's bf16 training, the Qwen3 LoRA and QLoRA
    steps (each in a process of its own), decoding at batch 1 and 8, and the cuDNN rows, which
    on a CPU ask for zoo's CPU attention (training) or XLA's (decoding against a cache) and find
    no cuDNN call."""
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # it sets both: restored after
    monkeypatch.setenv("XLA_FLAGS", os.environ["XLA_FLAGS"])  # (tests/conftest.py sets it)
    out = tmp_path / "device_check.json"
    report = device_check.main(["--small", "--models", "xor", "--json", str(out)])
    assert json.loads(out.read_text()) == report
    assert report["ok"] and report["device"] == "cpu" and report["jax"] == jax.__version__
    assert set(report["section_seconds"]) == set(device_check.SECTIONS)
    (xor,) = report["models"]
    assert xor["model"] == "xor" and xor["steps_per_sec"] > 0 and math.isfinite(xor["loss"])
    gpt2 = report["gpt2"]
    assert 0 < gpt2["tokens_per_sec"]["min"] and 0 < gpt2["mfu"]["median"]
    assert gpt2["peak_source"] == "measured float32 matmul"
    lora, qlora = report["qwen3"]["lora"], report["qwen3"]["qlora"]
    for case in (lora, qlora):
        assert case["step_seconds"] > 0 and math.isfinite(case["loss"])
        assert case["device_memory"] == {}  # XLA:CPU keeps no allocator statistics
    # nf4 codes hold the base kernels in a quarter of bfloat16's bytes.
    assert qlora["compiled_memory"]["arguments"] < lora["compiled_memory"]["arguments"]
    assert [row["batch"] for row in report["decode"]] == [1, 8]
    assert all(row["decode_tokens_per_s"] > 0 for row in report["decode"])
    steps = ["gpt2 bf16 train", "qwen3 lora train", "qwen3 qlora train", "qwen3 bf16 decode"]
    assert [row["step"] for row in report["cudnn"]] == steps
    assert [row["route"] for row in report["cudnn"]] == ["cpu", "cpu", "cpu", "xla"]
    assert not any(row["cudnn"] for row in report["cudnn"])


def test_device_check_trains_a_model_on_noise_where_its_data_set_is_missing(tmp_path):
    """As on a machine without the model's default data set: random examples of its shape."""
    facts = registry.get_data("digits").info
    data = device_check.stand_in("mlp", "digits", facts)
    assert data.name == "random 8x8x1 (no digits)"
    assert data.splits.train["image"].shape == (1024, 8, 8, 1)
    tiny = dataclasses.replace(data, keys=[*data.keys, *registry.get_model("mlp").tiny])
    row = device_check.model_run("mlp", tiny, 2, str(tmp_path))
    assert row["ok"] and row["data"] == data.name and row["steps_per_sec"] > 0


def test_device_check_peaks_and_refusals(capsys):
    h200 = SimpleNamespace(platform="gpu", device_kind="NVIDIA H200")
    assert device_check.peak_flops(h200, None) == (989e12, "H200 datasheet, dense bf16")
    assert device_check.peak_flops(h200, 500.0) == (500e12, "--peak-tflops")
    unknown = SimpleNamespace(platform="gpu", device_kind="Some GPU")
    assert device_check.peak_flops(unknown, None)[0] is None
    for option, bad in (("--only", "models,speed"), ("--models", "xor,nosuch")):
        with pytest.raises(SystemExit):
            device_check.parse([option, bad])
        assert f"{option} {bad.split(',')[1]}: choose from" in capsys.readouterr().err


def test_state_hashes_see_one_bit_and_nothing_else():
    """`benchmarks.state_hashes`' hash: the same for equal states (keys included), another for
    a state one float32 bit away."""
    weights = jnp.arange(4, dtype=jnp.float32)
    state = {"w": weights, "key": jax.random.key(0)}
    same = {"w": weights.copy(), "key": jax.random.key(0)}
    tiny = np.nextafter(np.float32(0), np.float32(1))
    moved = {"w": weights.at[0].set(tiny), "key": jax.random.key(0)}
    assert state_hash(state) == state_hash(same) != state_hash(moved)


def test_experts_benchmark_compares_the_products_and_trains_both_decoders(tmp_path):
    """`benchmarks.experts` at small sizes: the three products compute the same loss, each
    figure is there, on one device and on the two meshes; the memory of a tiny mixture's
    steps (8 experts: every case's mesh splits them), one per case, computed."""
    out = tmp_path / "experts.json"
    sizes = ["--experts", "4", "--dim", "32", "--expert-width", "16", "--tokens", "64"]
    sizes += ["--depth", "1", "--context", "16", "--batch", "8", "--steps", "1", "--rounds", "2"]
    sections = ["--sections", "product", "training", "meshes"]
    sections += ["--mesh-keys", "model.dim=32", "model.depth=1", "model.context_length=16"]
    sections += ["data.window=16", "trainer.batch_size=8"]
    report = experts.main([*sizes, *sections, "--json", str(out)])
    assert json.loads(out.read_text()) == report
    losses = {r["loss"] for r in report["product"].values()}
    assert max(losses) - min(losses) <= 1e-5 * max(losses)
    assert set(report["product"]) == {"grouped", "ragged_dot", "loop"}
    for product in report["product"].values():
        assert product["temporaries"] > 0 and product["seconds"]["median"] > 0
    assert set(report["training"]) == {"mixture", "dense"}
    assert report["training"]["dense"]["vs_dense"] == 1.0
    assert set(report["meshes"]) == {"data=4", "expert=4"}
    assert report["meshes"]["data=4"]["vs_data=4"] == 1.0
    config = json.loads((ROOT / "tests/fixtures/pretrained/qwen3-moe-norm/config.json").read_text())
    memory = experts.memory_figures(config, length=16)
    assert set(memory) == set(experts.MEMORY_CASES)
    for case in memory.values():
        assert 0 < case["arguments"] <= case["peak"] and case["temporaries"] > 0
    full = memory["full fine-tune, fsdp=8"]
    state = full["base"] // 2 * (2 + 4 + 4 + 4)  # bf16 params, float32 master and Adam moments
    assert full["devices"] == 8 and full["arguments"] < state

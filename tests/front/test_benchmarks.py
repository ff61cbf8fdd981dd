"""The benchmark entry points run end to end and write the JSON their readers expect."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import NO_COMPILE_CACHE, ROOT

from benchmarks import throughput


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

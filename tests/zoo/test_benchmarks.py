"""The benchmark entry point runs end to end and writes the JSON its readers expect."""

from __future__ import annotations

import json
import subprocess
import sys

from helpers import ROOT


def test_benchmark_runs_and_writes_every_figure(tmp_path):
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "benchmarks.run", "--models", "xor", "--windows", "2"]
    command += ["--window-seconds", "0.01", "--steps-per-dispatch", "10", "--json", str(out)]
    command += ["trainer.log_every=10"]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, timeout=300)
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

"""The costs benchmark runs end to end on xor and writes every figure its readers expect."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from helpers import ROOT


def assert_spread(figure: dict[str, float]) -> None:
    assert 0 < figure["min"] <= figure["median"] <= figure["max"], figure


def test_costs_benchmark_writes_every_figure(tmp_path):
    out = tmp_path / "costs.json"
    command = [sys.executable, "-m", "benchmarks.costs", "--models", "xor", "--repeats", "1"]
    command += ["--steps", "100", "--windows", "2", "--window-seconds", "0.05", "--json", str(out)]
    # In the session's compilation cache, which the benchmark turns off itself where it counts
    # compilations (its `compiles` section).
    done = subprocess.run(
        command,
        cwd=ROOT,
        env=os.environ,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())

    wall = report["wall"]["xor"]
    for figure in ("zoo_seconds", "bare_seconds", "ratio"):
        assert_spread(wall[figure])
    assert len(wall["per_pair"]) == 1
    assert 0.5 <= wall["zoo_accuracy"][0] <= 1 and 0.5 <= wall["bare_accuracy"][0] <= 1

    startup = report["startup"]["xor"]
    for figure in ("to_setup_seconds", "to_first_step_seconds", "wall_seconds"):
        assert_spread(startup[figure])
    assert startup["to_setup_seconds"]["max"] <= startup["to_first_step_seconds"]["min"]
    assert startup["to_first_step_seconds"]["max"] < startup["wall_seconds"]["min"]

    for devices in ("1", "8"):
        for run in ("fresh", "resumed"):
            functions = report["compiles"]["xor"][devices][run]
            # xor dispatches 50 steps at a time: its train step compiles inside `train_steps`.
            for step in ("train_steps", "eval_step"):
                assert functions[step]["count"] == functions[step]["signatures"] == 1, functions
                assert functions[step]["seconds"] > 0

        saved = report["checkpoint"]["xor"][devices]
        assert saved["parameters"] == 33
        assert saved["checkpoint_bytes"] > 0
        for figure in ("first_save_seconds", "later_save_seconds", "restore_seconds"):
            assert_spread(saved[figure])
        assert len(saved["restores"]) == 1

    sharded = report["devices"]["xor"]
    for devices in ("1", "8"):
        assert_spread(sharded["steps_per_sec"][devices])
        assert len(sharded["per_window"][devices]) == 2
    assert_spread(sharded["ratio"])
    for section in ("wall", "startup", "compiles", "checkpoint", "devices"):
        assert f"\n{section}: " in done.stdout  # each section's table is printed

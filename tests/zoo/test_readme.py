"""The README's commands and examples, executed so they cannot go stale."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

from helpers import ROOT, run_cli

README = (ROOT / "README.md").read_text()


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.DOTALL)


def test_first_lines_are_the_two_commands_and_ci_runs_the_test_one():
    first_block = code_blocks("")[0].strip().splitlines()
    assert len(first_block) == 2
    train_command, test_command = first_block
    assert train_command.endswith("python -m zoo.train model=xor")
    assert test_command.endswith("uv run pytest")
    ci_script = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci_script


def test_python_examples_run(tmp_path):
    script = "\n\n".join(code_blocks("python"))
    # The pretrained directory the image fine-tune names: a tiny timm ResNet-18 checkpoint.
    shutil.copytree(
        ROOT / "tests" / "fixtures" / "pretrained" / "resnet18-timm", tmp_path / "resnet18"
    )
    # The examples run as on a user's CPU machine, on one device: meshes have their own tests,
    # and several trainings in one process on 8 simulated devices sharing 2 cores is where
    # XLA:CPU's all-reduce rendezvous has (rarely) lost a participant.
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env={**os.environ, "JAX_NUM_CPU_DEVICES": "1"},
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    printed = result.stdout.splitlines()
    accuracies = [float(a) for a in printed[0].split()]  # your own images, in three formats
    assert len(accuracies) == 3 and min(accuracies) >= 0.7  # chance: 1/3
    assert (tmp_path / "runs" / "readme-shards" / "images-00000-of-00001.array_record").is_file()
    printed = printed[1:]
    listed = re.search(r"print\(zoo\.list_models\(\)\)  # (.+)", README).group(1)
    assert printed[0] == listed and printed[1] == "(2, 16)"
    assert printed[3].startswith("'")  # the gpt sample, printed as a Python string
    assert float(printed[4]) >= 0.9  # the user model's eval accuracy
    assert (tmp_path / "runs" / "readme-mlp" / "checkpoints" / "300").is_dir()
    assert printed[5] == "True"  # trainer.debug ran the steps on concrete arrays
    assert printed[6] == "200 200 300"  # the second run resumed from the first's checkpoint
    assert printed[7] == "fashion_mnist 150"  # the loaded model and its config
    assert float(printed[9]) >= 0.5  # the fine-tuned model on the user's digits (chance: 0.1)
    assert (tmp_path / "runs" / "readme-digits" / "checkpoints" / "150").is_dir()
    assert printed[10] == "[0]"  # a blue photo, read as the fine-tuned ResNet reads it
    assert float(printed[11]) >= 0.8  # the held-out photos (chance: 1/3)
    log = (tmp_path / "runs" / "readme-resnet" / "train.log").read_text()
    assert "data.normalize=none: model 'resnet' normalises its inputs itself" in log
    assert len(printed) == 12


def test_error_examples_match_real_output():
    examples = re.findall(
        r"^\$ python -m zoo\.train (.+)\n(error: .+)$", README, flags=re.MULTILINE
    )
    assert examples
    for args, expected in examples:
        result = run_cli(*args.split())
        assert result.returncode == 2
        assert result.stderr.strip() == expected

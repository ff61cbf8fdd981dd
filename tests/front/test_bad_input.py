"""Bad input on the command line, in single runs and sweeps alike: one paragraph naming the bad
value and what is valid, exit status 2, and nothing written or lost (every checkpoint, event
file, train.log and recorded config hashed before and after)."""

from __future__ import annotations

import hashlib
import os

import pytest
from helpers import run_cli

SWEEP = ("-m", "model=xor", "trainer.checkpoint_every=50")


def kept(directory) -> dict[str, str]:
    return {
        str(path): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def one_paragraph(stderr: str, *names: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr, stderr
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    """A sweep's workdir whose job 0 holds checkpoints at steps 200, 250 and 300."""
    workdir = tmp_path_factory.mktemp("sweep")
    result = run_cli(*SWEEP, "trainer.steps=300", f"workdir={workdir}")
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(workdir / "0" / "checkpoints")) == ["200", "250", "300"]
    return workdir


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["trainer.steps=300", "trainer.keep=0"], ["job 0", "trainer.keep=0", "at least 1"]),
        (
            ["trainer.steps=330", "trainer.steps_per_dispatch=50"],
            ["trainer.steps_per_dispatch=50", "trainer.steps=330"],
        ),
        (["optimizer.learning_rate=-0.1"], ["optimizer.learning_rate=-0.1", "positive"]),
        (["model.num_hidden=0"], ["model.num_hidden=0", "at least 1"]),
    ],
)
def test_a_sweep_checks_every_job_before_any_writes(swept, overrides, names):
    """The issue's case first: a sweep with trainer.keep=0 over a workdir with checkpoints."""
    before = kept(swept)
    result = run_cli(*SWEEP, *overrides, f"workdir={swept}")
    assert result.returncode == 2
    one_paragraph(result.stderr, *names)
    assert kept(swept) == before


def test_a_bad_job_of_a_sweep_fails_alone_and_the_sweep_exits_2(tmp_path):
    result = run_cli(
        "-m",
        "model=xor",
        "trainer.steps_per_dispatch=50",
        "trainer.steps=130,100",
        f"workdir={tmp_path}",
    )
    assert result.returncode == 2
    one_paragraph(result.stderr, "job 0 (", "trainer.steps=130")
    assert sorted(os.listdir(tmp_path)) == ["1"]  # the good job ran; the bad one wrote nothing
    assert (tmp_path / "1" / "checkpoints" / "100").is_dir()


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["optimizer.learning_rate=nan"], ["learning_rate=nan", "positive"]),
        (["optimizer.learning_rate=inf"], ["learning_rate=inf", "positive"]),
        (["optimizer.grad_clip_norm=-1"], ["grad_clip_norm=-1.0", "positive (or null)"]),
        (["optimizer.final_lr_fraction=-0.5"], ["final_lr_fraction=-0.5", "between 0 and 1"]),
        (["mesh.cpu_devices=-1"], ["mesh.cpu_devices=-1"]),
        (["model.num_hidden=0"], ["model.num_hidden=0", "at least 1"]),
        (["model.num_hidden=-3"], ["model.num_hidden=-3", "at least 1"]),
        (["model=xor", "data.train_size=0"], ["data.train_size=0", "at least 1"]),
        (["trainer.batch_size=100000000000"], ["batch_size=100000000000", "GiB", "available"]),
        (["trainer.steps=100", "trainer.steps=150"], ["trainer.steps is given twice", "-m"]),
    ],
)
def test_values_out_of_range_are_refused_before_anything_is_written(tmp_path, overrides, names):
    existing = tmp_path / "train.log"
    existing.write_text("an earlier run's log\n")
    result = run_cli(*overrides, f"workdir={tmp_path}")
    assert result.returncode == 2
    one_paragraph(result.stderr, *names)
    assert sorted(os.listdir(tmp_path)) == ["train.log"]
    assert existing.read_text() == "an earlier run's log\n"


def test_an_empty_workdir_is_refused(tmp_path):
    result = run_cli("model=xor", "workdir=", cwd=tmp_path)
    assert result.returncode == 2
    one_paragraph(result.stderr, "workdir is empty")
    assert not any(tmp_path.iterdir())


def test_an_error_found_once_the_trainer_is_built_writes_nothing(swept, tmp_path):
    """A batch that 3 devices cannot split is found when the mesh is made, after the config
    composed: the existing run's config, log, events and checkpoints stay as they were, and a
    fresh workdir is not even created."""
    existing = swept / "0"
    before = kept(existing)
    result = run_cli(
        "model=xor",
        "trainer.steps=300",
        "mesh.cpu_devices=3",
        f"workdir={existing}",
        env={"JAX_NUM_CPU_DEVICES": None},
    )
    assert result.returncode == 2
    one_paragraph(result.stderr, "trainer.batch_size=128", "multiple of 3")
    assert kept(existing) == before
    fresh = tmp_path / "fresh"
    result = run_cli(
        "model=xor", "mesh.cpu_devices=3", f"workdir={fresh}", env={"JAX_NUM_CPU_DEVICES": None}
    )
    assert result.returncode == 2
    assert not fresh.exists()

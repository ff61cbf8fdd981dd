"""Exact resume: runs killed with real signals in real subprocesses, resumed with the same
command, end with the bits of an uninterrupted run; plus the failure modes around checkpoints."""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys

import helpers
import jax
import numpy as np
import pytest
import stateful_model
from flax import nnx
from helpers import ROOT, assert_same_bits, overriding, read_events, scalar_steps
from zoo.engine.checkpoints.manager import Checkpointer
from zoo.engine.checkpoints.reader import abstract_like
from zoo.engine.loop.trainer import Trainer
from zoo.engine.pipeline import batches as pipeline
from zoo.engine.registry import Splits, get_data

import zoo

PLUGIN_ENV = {"ZOO_PLUGINS": "stateful_model", "PYTHONPATH": str(ROOT / "tests")}
run_cli = functools.partial(helpers.run_cli, devices=8)  # as the killed runs (`run_and_signal`)
STEPS, EVERY = 80, 10

XOR = ("model=xor", f"trainer.steps={STEPS}", "trainer.log_every=1", "trainer.steps_per_dispatch=1")
STATEFUL = (f"model={stateful_model.NAME}", f"trainer.steps={STEPS}", "trainer.log_every=1")
FSDP8 = (*STATEFUL, "model.embed=16", "mesh.fsdp=8")
CASES = {"xor": XOR, "dropout_bn": STATEFUL, "dropout_bn_fsdp8": FSDP8}


def command(case: str, workdir) -> list[str]:
    return [*CASES[case], f"trainer.checkpoint_every={EVERY}", f"workdir={workdir}"]


def run_and_signal(args: list[str], workdir, kill_after: int, signum: int):
    return helpers.run_and_signal(args, workdir, kill_after, signum, STEPS, PLUGIN_ENV)


def restore_final(case: str, workdir, step: int = STEPS) -> nnx.State:
    """The state saved at `step`, restored onto the mesh that the case's config asks for."""
    trainer = Trainer(zoo.compose(command(case, workdir)))
    checkpointer = Checkpointer(workdir / "checkpoints")
    try:
        return checkpointer.restore_state(step, abstract_like(trainer.state))
    finally:
        checkpointer.close()


def losses(workdir) -> dict[int, float]:
    events = read_events(workdir)
    scalars = events.Scalars("train/loss")
    steps = [event.step for event in scalars]
    assert len(steps) == len(set(steps)), "a step was logged twice"
    return scalar_steps(events, "train/loss")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """One uninterrupted run per case, shared by the SIGKILL and SIGTERM tests."""
    done = {}

    def get(case: str):
        if case not in done:
            workdir = tmp_path_factory.mktemp(f"full-{case}")
            result = run_cli(*command(case, workdir), env=PLUGIN_ENV)
            assert result.returncode == 0, result.stderr
            done[case] = (workdir, restore_final(case, workdir), losses(workdir))
        return done[case]

    return get


@pytest.mark.parametrize(
    ("case", "signum", "seed"),
    [
        pytest.param("xor", signal.SIGKILL, 1, id="xor-SIGKILL"),
        pytest.param("xor", signal.SIGTERM, 2, id="xor-SIGTERM"),
        pytest.param("xor", signal.SIGINT, 6, id="xor-SIGINT"),
        pytest.param("dropout_bn", signal.SIGKILL, 3, id="dropout_bn-SIGKILL"),
        pytest.param("dropout_bn", signal.SIGTERM, 4, id="dropout_bn-SIGTERM"),
        pytest.param("dropout_bn_fsdp8", signal.SIGKILL, 5, id="dropout_bn_fsdp8-SIGKILL"),
    ],
)
def test_killed_and_resumed_run_ends_with_the_same_bits(
    uninterrupted, tmp_path, case, signum, seed
):
    _, full_state, full_losses = uninterrupted(case)
    # A random step after the first checkpoint, far enough from the end to be reached first.
    kill_after = int(np.random.default_rng(seed).integers(EVERY + 1, STEPS // 2))
    args = command(case, tmp_path)

    code, stderr = run_and_signal(args, tmp_path, kill_after, signum)
    saved = Checkpointer(tmp_path / "checkpoints")
    steps = saved.all_steps()
    saved.close()
    if signum == signal.SIGKILL:
        assert code == -signal.SIGKILL, stderr
        restart = max(steps)
        assert EVERY <= restart < STEPS
    else:  # the step in flight finishes, a checkpoint is saved there, exit status 128 + signum
        assert code == 128 + signum, stderr
        restart = max(steps)
        assert kill_after < restart < STEPS, steps
        assert f"Stopped by {signal.Signals(signum).name} after step {restart}" in stderr
        assert "Traceback" not in stderr

    resumed = run_cli(*args, env=PLUGIN_ENV)
    assert resumed.returncode == 0, resumed.stderr
    assert f"Resuming at step {restart}" in resumed.stderr

    assert_same_bits(restore_final(case, tmp_path), full_state)
    resumed_losses = losses(tmp_path)
    assert set(range(restart + 1, STEPS + 1)) <= set(resumed_losses)
    assert set(resumed_losses) <= set(full_losses)
    for step, value in resumed_losses.items():
        assert value == full_losses[step], step  # the same float32 bits
    if signum != signal.SIGKILL:  # a clean stop flushed every window it had closed
        assert resumed_losses == full_losses


def test_save_killed_midway_is_skipped_on_resume(uninterrupted, tmp_path):
    """SIGKILL while Orbax is writing a checkpoint (its `<step>.orbax-checkpoint-tmp` directory
    exists): the next run resumes from the last complete one and removes the leftover."""
    _, full_state, _ = uninterrupted("xor")
    args = command("xor", tmp_path)
    process = subprocess.Popen(
        [sys.executable, "-m", "zoo.train", *args],
        cwd=ROOT,
        env={**os.environ, "JAX_NUM_CPU_DEVICES": "8"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    directory, caught = tmp_path / "checkpoints", []
    while process.poll() is None and not caught:
        names = os.listdir(directory) if directory.is_dir() else []
        complete = [n for n in names if n.isdigit()]
        caught = [n for n in names if ".orbax-checkpoint-tmp" in n and complete]
    if caught:
        process.kill()
    process.wait()
    assert caught, "the run finished without a save in progress being seen"
    partial = int(caught[0].partition(".")[0])
    complete = sorted(int(n) for n in os.listdir(directory) if n.isdigit())
    assert process.returncode == -signal.SIGKILL and complete and max(complete) < partial

    resumed = run_cli(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert f"Resuming at step {max(complete)}" in resumed.stderr
    assert not [n for n in os.listdir(directory) if "tmp" in n]
    assert_same_bits(restore_final("xor", tmp_path), full_state)


@pytest.mark.parametrize("damage", ["truncated", "deleted"])
def test_unreadable_checkpoint_is_named_and_auto_falls_back(uninterrupted, tmp_path, damage):
    full_dir, full_state, _ = uninterrupted("xor")
    shutil.copytree(full_dir, tmp_path, dirs_exist_ok=True)
    damaged = tmp_path / "checkpoints" / str(STEPS)
    if damage == "truncated":
        for chunk in (damaged / "state" / "d").iterdir():  # the arrays' data
            chunk.write_bytes(chunk.read_bytes()[:50])
    else:
        (damaged / "state" / "manifest.ocdbt").unlink()
    args = [*command("xor", tmp_path)]

    explicit = run_cli(*args, f"trainer.resume={STEPS}")
    assert explicit.returncode == 2
    message = explicit.stderr.strip()
    assert message.startswith("error: ") and "\n" not in message, message
    assert f"trainer.resume={STEPS}" in message and str(damaged) in message
    assert sorted(os.listdir(damaged.parent)) == sorted(os.listdir(full_dir / "checkpoints"))

    auto = run_cli(*args)
    assert auto.returncode == 0, auto.stderr
    assert "Traceback" not in auto.stderr
    before = STEPS - EVERY
    assert f"Checkpoint at step {STEPS} ({damaged}) cannot be read" in auto.stderr
    assert f"Falling back to step {before}" in auto.stderr
    assert f"Resuming at step {before}" in auto.stderr
    assert (damaged.parent / f"{STEPS}.unreadable").is_dir()  # kept for inspection
    assert_same_bits(restore_final("xor", tmp_path), full_state)


def test_checkpoint_restores_onto_other_meshes(uninterrupted, tmp_path):
    """Written on 8 devices with fsdp=8; restored on 1 device and on data=2 x tensor=2, each leaf
    placed with the new mesh's sharding, the values unchanged; and training goes on there."""
    full_dir, full_state, _ = uninterrupted("dropout_bn_fsdp8")
    kernel = full_state[0]["embed"]["kernel"][...]
    assert jax.typeof(kernel).sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    assert len(kernel.sharding.device_set) == 8
    for mesh, devices in [(("mesh.data=1",), 1), (("mesh.data=2", "mesh.tensor=2"), 4)]:
        overrides = overriding(*command("dropout_bn_fsdp8", full_dir), "mesh.fsdp=1", *mesh)
        trainer = Trainer(zoo.compose(overrides), jax.devices()[:devices])
        checkpointer = Checkpointer(full_dir / "checkpoints")
        try:
            restored = checkpointer.restore_state(STEPS, abstract_like(trainer.state))
        finally:
            checkpointer.close()
        assert_same_bits(restored, full_state)
        for new, target in zip(
            jax.tree.leaves(restored), jax.tree.leaves(trainer.state), strict=True
        ):
            assert new.sharding == target.sharding
        moved = restored[0]["fc1"]["kernel"][...]
        assert len(moved.sharding.device_set) == devices
    # Resuming on another mesh is allowed: the run goes on from the restored step.
    shutil.copytree(full_dir, tmp_path, dirs_exist_ok=True)
    more = overriding(
        *command("dropout_bn_fsdp8", tmp_path), "mesh.fsdp=1", "mesh.data=2", "mesh.tensor=2"
    )
    result = Trainer(
        zoo.compose(overriding(*more, f"trainer.steps={STEPS + 20}")), jax.devices()[:4]
    ).fit()
    assert result.step == STEPS + 20
    assert len(result.model.fc1.kernel[...].sharding.device_set) == 4


def snapshot(directory) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_changed_config_is_refused_with_a_diff_and_allowed_changes_resume(uninterrupted, tmp_path):
    full_dir, _, full_losses = uninterrupted("xor")
    shutil.copytree(full_dir, tmp_path, dirs_exist_ok=True)
    before = snapshot(tmp_path)
    args = command("xor", tmp_path)

    changed = run_cli(*args, "model.num_hidden=16", "optimizer.learning_rate=0.5", "seed=3")
    assert changed.returncode == 2
    message = changed.stderr.strip()
    assert message.startswith("error: ") and "\n" not in message, message
    for change in (
        "model.num_hidden: 8 -> 16",
        "optimizer.learning_rate: 0.1 -> 0.5",
        "seed: 0 -> 3",
    ):
        assert change in message
    assert "trainer.steps" in message  # says what may change
    never = run_cli(*args, "trainer.resume=never")
    assert never.returncode == 2 and "trainer.resume=never" in never.stderr
    # Nothing was written: the checkpoints, event files, train.log and .hydra/ as they were.
    assert snapshot(tmp_path) == before

    longer = run_cli(*overriding(*args, f"trainer.steps={STEPS + 10}", "trainer.log_every=5"))
    assert longer.returncode == 0, longer.stderr
    assert f"Resuming at step {STEPS}" in longer.stderr
    assert f"trainer.steps: {STEPS} -> {STEPS + 10}" in longer.stderr
    resumed_losses = losses(tmp_path)
    assert set(resumed_losses) == set(full_losses) | {STEPS + 5, STEPS + 10}
    assert {s: resumed_losses[s] for s in full_losses} == full_losses


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("trainer.keep=0", ["trainer.keep=0", "at least 1"]),
        ("trainer.resume=latest", ["trainer.resume=latest", "auto", "never", "step"]),
        ("trainer.nan_policy=ignore", ["ignore", "stop", "skip"]),
        ("trainer.best_mode=low", ["low", "min", "max"]),
    ],
)
def test_bad_checkpoint_settings_fail_at_compose_time(override, names):
    with pytest.raises(zoo.ZooError) as error:
        zoo.compose(["model=xor", override])
    for name in names:
        assert name in str(error.value)


def test_unknown_best_metric_is_refused_before_training(tmp_path):
    with pytest.raises(zoo.ZooError, match="best_metric=acc .* valid: accuracy, loss"):
        zoo.run(zoo.compose(["model=xor", "trainer.best_metric=acc", f"workdir={tmp_path}"]))
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize(("mode", "keep"), [("max", 2), ("min", 1)])
def test_retention_keeps_latest_and_best(tmp_path, mode, keep):
    """`keep` latest plus the best by val/loss. With mode=max the 'best' is the highest loss,
    an early step, so the best really is older than the latest ones."""
    result = zoo.run(
        zoo.compose(
            [
                "model=xor",
                "trainer.steps=60",
                "trainer.steps_per_dispatch=1",
                "trainer.checkpoint_every=10",
                "trainer.eval_every=10",
                f"trainer.keep={keep}",
                "trainer.best_metric=loss",
                f"trainer.best_mode={mode}",
                f"workdir={tmp_path}",
            ]
        )
    )
    eval_loss = scalar_steps(read_events(tmp_path), "val/loss")
    assert sorted(eval_loss) == [10, 20, 30, 40, 50, 60]
    best = (max if mode == "max" else min)(eval_loss, key=eval_loss.get)
    latest = list(range(60, 60 - 10 * keep, -10))
    checkpointer = Checkpointer(tmp_path / "checkpoints")
    kept = checkpointer.all_steps()
    checkpointer.close()
    assert kept == sorted({best, *latest})
    if mode == "max":
        assert best not in latest  # the policy really kept an old one
    assert result.step == 60


def _register_nan_data() -> None:
    if "xor_nan_row" in zoo.list_datasets():
        return

    @zoo.register_data("xor_nan_row")
    def xor_nan_row(nan_row: int = 0) -> Splits:
        """The xor data with one training input replaced by NaN."""
        splits = get_data("xor").splits({})
        inputs = splits.train["inputs"].copy()
        inputs[nan_row] = np.nan
        return Splits(train={**splits.train, "inputs": inputs}, eval=splits.eval)


def nan_run(tmp_path, policy: str):
    """A row that the pipeline first serves at step 15 (in epoch 0, which every row is seen
    once in): the steps that see it, and the run's config."""
    _register_nan_data()
    rows = iter(pipeline.train_batches({"row": np.arange(2500)}, 128, seed=0))
    batches = [next(rows)["row"] for _ in range(60)]
    row = int(batches[14][0])
    bad_steps = [i + 1 for i, batch in enumerate(batches) if row in batch]
    cfg = zoo.compose(
        [
            "model=xor",
            "data=xor_nan_row",
            f"data.nan_row={row}",
            "trainer.steps=60",
            "trainer.steps_per_dispatch=1",
            "trainer.checkpoint_every=10",
            "trainer.log_every=5",
            f"trainer.nan_policy={policy}",
            f"workdir={tmp_path}",
        ]
    )
    return cfg, bad_steps


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    cfg, bad_steps = nan_run(tmp_path, "stop")
    assert bad_steps[0] == 15 and len(bad_steps) > 1
    with pytest.raises(zoo.NonFiniteLoss) as error:
        zoo.run(cfg)
    message = str(error.value)
    assert "train/loss" in message and "at step 15" in message
    checkpointer = Checkpointer(tmp_path / "checkpoints")
    steps = checkpointer.all_steps()
    assert steps == [10]
    assert f"last good checkpoint is step 10 ({checkpointer.step_path(10)})" in message
    state = checkpointer.restore_state(10, abstract_like(Trainer(cfg).state))
    checkpointer.close()
    assert all(
        np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state) if x.dtype.kind == "f"
    )


def test_nan_loss_skip_drops_those_updates(tmp_path, caplog):
    cfg, bad_steps = nan_run(tmp_path, "skip")
    result = zoo.run(cfg)
    floats = [x for x in jax.tree.leaves(result.state) if x.dtype.kind == "f"]
    assert all(np.isfinite(np.asarray(x)).all() for x in floats)
    _, optimizer = nnx.merge(Trainer(cfg).graphdef, result.state)
    assert int(optimizer.step[...]) == 60 - len(bad_steps)  # one update skipped per bad step
    skipped = [r.getMessage() for r in caplog.records if "Skipped" in r.getMessage()]
    assert len(skipped) == len(bad_steps)
    for step, line in zip(bad_steps, skipped, strict=True):
        assert f"the first at step {step}" in line


def test_checkpoints_gone_between_set_up_and_start_are_named(tmp_path):
    """A run set up to resume is built abstract (its arrays all come from the checkpoint): if
    the checkpoints are removed before it starts, it stops saying so, rather than train on
    nothing."""
    args = overriding(*XOR, "trainer.steps=10", f"workdir={tmp_path}")
    zoo.run(zoo.compose(args))
    trainer = Trainer(zoo.compose(overriding(*args, "trainer.steps=20")))
    shutil.rmtree(tmp_path / "checkpoints")
    with pytest.raises(zoo.ZooError, match=r"set up to resume from are gone"):
        trainer.fit()

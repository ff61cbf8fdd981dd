"""`trainer.steps_per_dispatch=K`: K steps per host call give the bits and the logs of K=1."""

from __future__ import annotations

import pytest
import stateful_model
from helpers import assert_same_bits, overriding, read_events, run_cli, scalar_steps
from zoo.engine.loop.trainer import Trainer

import zoo

MODEL = stateful_model.NAME


def train(workdir, *overrides: str) -> zoo.RunResult:
    return zoo.run(zoo.compose(overriding(f"model={MODEL}", f"workdir={workdir}", *overrides)))


def test_k_steps_per_dispatch_equal_one_step_per_dispatch_and_resume_exactly(tmp_path):
    one = train(tmp_path / "one", "trainer.checkpoint_every=20")
    # Interrupted after 40 of 60 steps, then resumed: still the same bits as one uninterrupted
    # run at K=1, and the same logged means per window.
    train(tmp_path / "four", "trainer.steps_per_dispatch=4", "trainer.steps=40")
    four = train(tmp_path / "four", "trainer.steps_per_dispatch=4", "trainer.checkpoint_every=20")
    assert four.start_step == 40
    assert_same_bits(four.state, one.state)
    assert four.eval_metrics == one.eval_metrics
    for tag in ("train/loss", "train/accuracy"):
        assert scalar_steps(read_events(four.workdir), tag) == scalar_steps(
            read_events(one.workdir), tag
        )


def test_a_run_resumes_with_another_k_and_the_same_bits(tmp_path):
    one = train(tmp_path / "one")
    train(tmp_path / "switch", "trainer.steps=20")
    switched = train(tmp_path / "switch", "trainer.steps_per_dispatch=20")
    assert switched.start_step == 20
    assert_same_bits(switched.state, one.state)
    assert switched.eval_metrics == one.eval_metrics


def test_a_k_that_does_not_divide_the_resume_step_is_refused_intact(tmp_path):
    train(tmp_path, "trainer.steps=20")
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with pytest.raises(zoo.ZooError, match="steps_per_dispatch=3 cannot resume at step 20"):
        train(tmp_path, "trainer.steps=60", "trainer.log_every=30", "trainer.steps_per_dispatch=3")
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == saved


@pytest.mark.parametrize("k", [1, 4])
def test_the_prefetch_thread_gives_the_same_bits_and_resumes_exactly(tmp_path, k):
    """Accelerators fetch and place batches on a Grain thread (CPU devices fetch inline): the
    thread must not change what each step gets, nor the position a checkpoint records."""
    inline = train(tmp_path / "inline")

    def prefetching(*overrides: str) -> zoo.RunResult:
        config = [f"model={MODEL}", f"workdir={tmp_path / 'thread'}", *overrides]
        trainer = Trainer(zoo.compose([*config, f"trainer.steps_per_dispatch={k}"]))
        trainer.dispatcher.prefetch = 2
        return trainer.fit()

    prefetching("trainer.steps=20")
    resumed = prefetching()
    assert resumed.start_step == 20
    assert_same_bits(resumed.state, inline.state)
    assert resumed.eval_metrics == inline.eval_metrics


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["trainer.steps_per_dispatch=0"], "trainer.steps_per_dispatch=0 must be at least 1"),
        (
            ["trainer.steps_per_dispatch=8", "trainer.checkpoint_every=30"],
            "must divide trainer.steps=60, trainer.log_every=20, trainer.checkpoint_every=30",
        ),
    ],
)
def test_bad_steps_per_dispatch_is_refused_naming_the_values(overrides, named):
    with pytest.raises(zoo.ZooError, match=named):
        zoo.compose([f"model={MODEL}", *overrides])


def test_cli_refuses_cadences_not_divisible_with_exit_2():
    result = run_cli("model=xor", "trainer.steps_per_dispatch=3")
    assert result.returncode == 2
    assert "trainer.steps_per_dispatch=3 must divide trainer.steps=2000" in result.stderr

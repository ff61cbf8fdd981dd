"""A trial run with nothing but `trainer.steps=N`: the model's default warm-up and steps per
dispatch are fitted to it (one console line each), and the update norms are sampled anyway."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from helpers import read_events, run_cli
from omegaconf import OmegaConf
from zoo.engine.checkpoints import resume

import zoo


@pytest.mark.parametrize("model", zoo.list_models())
def test_every_model_composes_a_forty_step_run(model, caplog):
    with caplog.at_level(logging.INFO, logger="zoo"):
        cfg = zoo.compose([f"model={model}", "trainer.steps=40"])
    default = zoo.get_model(model).optimizer.get("warmup_steps", 0)
    assert cfg.optimizer.warmup_steps == (default if default <= 40 else pytest.approx(
        default * 40 / zoo.get_model(model).trainer["steps"], abs=0.5))  # fmt: skip
    assert 40 % cfg.trainer.steps_per_dispatch == 0
    fitted = [r.getMessage() for r in caplog.records if "instead" in r.getMessage()]
    assert len(fitted) == (default > 40) + (zoo.get_model(model).trainer.get(
        "steps_per_dispatch", 1) != cfg.trainer.steps_per_dispatch)  # fmt: skip


@pytest.fixture(scope="module")
def gpt_trial(tmp_path_factory):
    """`python -m zoo.train model=gpt trainer.steps=40` (a small gpt on 64-byte windows)."""
    workdir = tmp_path_factory.mktemp("gpt")
    tiny = ("model.dim=32", "model.depth=1", "model.context_length=64", "data.window=64")
    result = run_cli("model=gpt", *tiny, "data.eval_bytes=4096", "trainer.steps=40",
                     f"workdir={workdir}")  # fmt: skip
    assert result.returncode == 0, result.stderr
    return workdir, result


def test_the_gpt_trial_run_says_how_it_warms_up(gpt_trial):
    _, result = gpt_trial
    line = (
        "optimizer.warmup_steps: model 'gpt' warms up for 100 steps in its default run of "
        "1400, longer than this run's trainer.steps=40; warming up for 3 steps instead"
    )
    assert result.stderr.splitlines()[0].startswith(line)


def test_a_run_shorter_than_norms_every_samples_its_norms(gpt_trial):
    events = read_events(gpt_trial[0])
    for name in ("grad_norm", "param_norm", "update_ratio"):  # norms_every=500 > 40 steps
        assert [e.step for e in events.Scalars(f"vitals/{name}")] == [1]


def test_a_gpt_fine_tune_reads_the_data_as_its_run_did(gpt_trial, tmp_path):
    """Fine-tuning the 64-byte-window gpt needs nothing but the steps and a workdir: the run's
    `data.*` settings come with its model's sizes."""
    tuned = zoo.finetune(gpt_trial[0], "trainer.steps=2", "trainer.log_every=2",
                         f"workdir={tmp_path}")  # fmt: skip
    assert tuned.config.data.window == 64 and tuned.config.data.eval_bytes == 4096
    assert tuned.config.optimizer.warmup_steps == 0  # the default warm-up, fitted to the run
    assert np.isfinite(tuned.eval_metrics["loss"])


def test_an_explicit_dispatch_that_does_not_divide_stays_an_error():
    with pytest.raises(zoo.ZooError, match="steps_per_dispatch=50 must divide trainer.steps=40"):
        zoo.compose(["model=xor", "trainer.steps=40", "trainer.steps_per_dispatch=50"])


def test_a_fitted_warmup_may_change_at_a_resume_past_it():
    """A trial run of 40 steps resumed to 80 fits the default warm-up anew (3 -> 7 steps for
    cnn): allowed once the run is past both, refused while either is still warming up."""
    short = zoo.compose(["model=cnn", "data=digits", "trainer.steps=40"])
    longer = zoo.compose(["model=cnn", "data=digits", "trainer.steps=80"])
    saved, current = (OmegaConf.to_container(c, resolve=True) for c in (short, longer))
    assert (saved["optimizer"]["warmup_steps"], current["optimizer"]["warmup_steps"]) == (3, 7)
    allowed = resume.check_config(40, "ckpt", saved, current)
    assert "optimizer.warmup_steps: 3 -> 7" in allowed
    with pytest.raises(zoo.ZooError, match=r"optimizer.warmup_steps: 3 -> 7\. A resumed run"):
        resume.check_config(5, "ckpt", saved, current)

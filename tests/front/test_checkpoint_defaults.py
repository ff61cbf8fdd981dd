"""zoo's own text lengths fitted to a model with fewer positions, each said in one line: the
tiny GPT-2 checkpoint (64 positions) on `data=text`, whose default window is 128 and whose
default buckets reach 256; a length the user set that does not fit stays an error. (The
checkpoint fine-tunes on text with the fitted window: tests/front/test_hub.py.)"""

from __future__ import annotations

import logging

import pytest
from helpers import ROOT

import zoo
from zoo.train import plan

TINY = ROOT / "tests" / "fixtures" / "pretrained" / "gpt2-tiny"
START = f"finetune.init_from={TINY}"


@pytest.mark.parametrize(
    ("overrides", "window", "buckets", "said"),
    [
        ([START], 64, [32, 64, 128, 256], "data.window: model 'gpt' has model.context_length=64"),
        ([START, "data.mode=lines"], 128, [32, 64], "using buckets [32, 64] instead"),
        (["model=gpt", "model.context_length=96"], 96, [32, 64, 128, 256], "windows of 96"),
        (
            ["model=gpt", "model.context_length=96", "data.mode=lines"],
            128,
            [32, 64, 96],
            "using buckets [32, 64, 96] instead",
        ),
        ([START, "data.window=32"], 32, [32, 64, 128, 256], None),
        (["model=gpt"], 128, [32, 64, 128, 256], None),
    ],
)
def test_default_lengths_fit_the_models_context(overrides, window, buckets, said, caplog):
    with caplog.at_level(logging.INFO, logger="zoo"):
        cfg = zoo.compose(overrides)
    assert (cfg.data.window, list(cfg.data.buckets)) == (window, buckets)
    fitted = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data.")]
    assert len(fitted) == (said is not None)  # one line for what was fitted, none otherwise
    if said is not None:
        assert said in fitted[0] and "(set data." in fitted[0]


@pytest.mark.parametrize(
    "setting", ["data.window=128", "data.buckets=[32,256]"], ids=["window", "buckets"]
)
def test_a_length_the_user_set_that_does_not_fit_stays_an_error(setting, tmp_path):
    mode = ["data.mode=lines"] if "buckets" in setting else []
    (job,) = plan([START, setting, *mode, f"workdir={tmp_path}"], multirun=False)
    assert job.config is None
    key, value = setting.split("=")
    said = f"{key}={value.replace(',', ', ')} would give model 'gpt' sequences of "
    assert job.error.startswith(said + ("256" if "buckets" in key else "128"))
    assert "more than model.context_length=64" in job.error and f"leave {key} out" in job.error

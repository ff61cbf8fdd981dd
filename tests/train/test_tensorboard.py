"""What a run shows in TensorBoard, read back through a real `tensorboard` server's HTTP API:
scalars, histograms, images, text and HParams; a profiler trace; events readable while a run
trains and complete after SIGTERM; and histograms that leave a run's bits alone."""

from __future__ import annotations

import glob
import io
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    NO_COMPILE_CACHE,
    ROOT,
    assert_same_bits,
    overriding,
    read_events,
    run_cli,
    scalar_steps,
)
from PIL import Image
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData
from zoo.engine.checkpoints.manager import Checkpointer
from zoo.engine.checkpoints.reader import abstract_like
from zoo.engine.loop.trainer import Trainer
from zoo.engine.report.summaries import COLUMNS, column_name

import zoo
from benchmarks.tensorboard_screens import fetch_json, tensorboard, wait_for_tags

STEPS, LOG_EVERY, EVAL_EVERY, HISTOGRAM_EVERY, BATCH = 40, 10, 20, 20, 64
HIDDEN = 32
RUN = "mlp"  # the run's directory under the server's --logdir


def mlp_args(workdir, *extra: str) -> list[str]:
    return overriding(
        "model=mlp",
        f"model.hidden_sizes=[{HIDDEN}]",
        f"trainer.steps={STEPS}",
        f"trainer.batch_size={BATCH}",
        f"trainer.log_every={LOG_EVERY}",
        f"trainer.eval_every={EVAL_EVERY}",
        "optimizer.warmup_steps=0",
        f"workdir={workdir}",
        *extra,
    )


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    """One finished run with histograms and a profiler trace, trained through the CLI."""
    logdir = tmp_path_factory.mktemp("runs")
    workdir = logdir / RUN
    extra = (
        f"logging.histogram_every={HISTOGRAM_EVERY}",
        f"logging.norms_every={LOG_EVERY}",
        "trainer.profile_steps=[3,5]",
    )
    # On the 8 devices of this process, whose run without them it is compared with.
    result = run_cli(*mlp_args(workdir, *extra), env=NO_COMPILE_CACHE, devices=8)
    assert result.returncode == 0, result.stderr
    return logdir, workdir, result


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.read()


def test_tensorboard_server_shows_every_tab(observed):
    logdir, _, _ = observed
    windows = list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    evals = [EVAL_EVERY, STEPS]
    with tensorboard(logdir) as base:
        scalar_tags = {
            *(f"train/{name}" for name in ("loss", "accuracy")),
            *(f"vitals/{name}" for name in ("learning_rate", "grad_norm", "param_norm")),
            "vitals/update_ratio",
            *(f"vitals/{name}" for name in ("steps_per_sec", "examples_per_sec")),
            "vitals/data_wait_share",
            "xla/compile_count",
            "xla/compile_seconds",
            "val/loss",
            "val/accuracy",
        }
        wait_for_tags(base, "scalars", {RUN: scalar_tags})
        histograms = {"weights/head/kernel", "weights/hidden/0/kernel/grad"}
        wait_for_tags(base, "histograms", {RUN: histograms})
        wait_for_tags(base, "images", {RUN: {"visuals/confusion_matrix", "visuals/misclassified"}})
        texts = {f"{t}/text_summary" for t in ("config", "model_summary")}
        wait_for_tags(base, "text", {RUN: texts})

        def scalars(tag: str) -> dict[int, float]:
            rows = fetch_json(f"{base}/data/plugin/scalars/scalars?run={RUN}&tag={tag}")
            return {step: value for _, step, value in rows}

        assert list(scalars("train/loss")) == windows
        assert list(scalars("val/accuracy")) == evals
        for name in ("grad_norm", "param_norm", "update_ratio"):
            norms = scalars(f"vitals/{name}")
            # every window, and the run's first step (a run shorter than norms_every samples too)
            assert list(norms) == [1, *windows] and all(v > 0 for v in norms.values()), name
        speed, examples = scalars("vitals/steps_per_sec"), scalars("vitals/examples_per_sec")
        for step in windows:
            assert examples[step] == pytest.approx(speed[step] * BATCH, rel=1e-5)
            assert 0 < scalars("vitals/data_wait_share")[step] < 1
        compiles = list(scalars("xla/compile_count").values())
        assert compiles[0] >= 1 and compiles == sorted(compiles)
        # stamped as of each window's last step: the eval at step 20 compiles after it
        assert scalars("xla/compile_count")[30] > scalars("xla/compile_count")[20]
        assert all(s > 0 for s in scalars("xla/compile_seconds").values())

        # Histograms: at the first step and every HISTOGRAM_EVERY steps, each over every value
        # of its array (a param's, and its gradient's beside it).
        histogram_steps = [1, *range(HISTOGRAM_EVERY, STEPS + 1, HISTOGRAM_EVERY)]
        for tag, size in (("weights/hidden/0/kernel", 64 * HIDDEN), ("weights/head/bias/grad", 10)):
            rows = fetch_json(f"{base}/data/plugin/histograms/histograms?run={RUN}&tag={tag}")
            assert [step for _, step, _ in rows] == histogram_steps
            for _, _, buckets in rows:
                assert sum(count for _, _, count in buckets) == size

        # Images: a confusion matrix and misclassified digits after each eval.
        url = f"{base}/data/plugin/images/images?run={RUN}&tag=visuals/confusion_matrix"
        entries = fetch_json(url)
        assert [entry["step"] for entry in entries] == evals
        png = fetch(f"{base}/data/plugin/images/individualImage?{entries[-1]['query']}")
        matrix = np.asarray(Image.open(io.BytesIO(png)))
        assert matrix.shape[0] > 10 * 36 and matrix.shape[2] == 3  # 10 rows of 36-pixel cells
        assert (matrix < 128).any(axis=2).sum() > 1000  # the counts and labels written in it
        url = f"{base}/data/plugin/images/images?run={RUN}&tag=visuals/misclassified"
        assert [entry["step"] for entry in fetch_json(url)] == evals

        def text(tag: str) -> str:
            url = f"{base}/data/plugin/text/text?run={RUN}&tag={tag}/text_summary"
            return fetch_json(url)[-1]["text"]

        summary = text("model_summary")
        params = 64 * HIDDEN + HIDDEN + HIDDEN * 10 + 10
        assert "hidden/0" in summary and f"{params:,}" in summary
        assert f"steps: {STEPS}" in text("config")
        assert "Sharding plan on mesh" in text("sharding_plan")
        cells = re.findall(r"<td>(\d+)</td>", text("visuals/confusion_matrix"))
        assert sum(map(int, cells)) == 360  # every eval digit once (row labels are bold)

        # HParams: the key columns of the config, model first, whole numbers as written, and
        # the run's final metrics as its session's values.
        experiment = fetch_json(f"{base}/data/plugin/hparams/experiment", {"experimentName": ""})
        infos = experiment["hparamInfos"]
        assert [info["displayName"] for info in infos] == list(COLUMNS)  # in the tab's order
        assert [info["name"] for info in infos] == sorted(info["name"] for info in infos)
        types = {info["displayName"]: info["type"] for info in infos}
        assert types["optimizer.learning_rate"] == "DATA_TYPE_FLOAT64"
        assert types["trainer.steps"] == types["seed"] == "DATA_TYPE_STRING"
        # every model's metrics, whichever run TensorBoard takes the description from
        metrics = {info["name"]["tag"] for info in experiment["metricInfos"]}
        assert {"val/accuracy", "val/bits_per_byte", "val/kl", "train/loss"} <= metrics
        request = {
            "experimentName": "",
            "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_RUNNING"],
            "startIndex": 0,
            "sliceSize": 10,
        }
        groups = fetch_json(f"{base}/data/plugin/hparams/session_groups", request)
        (group,) = groups["sessionGroups"]
        values = group["hparams"]
        assert values[column_name("model.name")] == "mlp"
        assert values[column_name("trainer.steps")] == str(STEPS)  # shown as 40, not 40.000
        assert values[column_name("seed")] == "0"
        assert values[column_name("optimizer.learning_rate")] == pytest.approx(1e-3)
        final = {m["name"]["tag"]: m["value"] for m in group["metricValues"]}
        assert final["val/accuracy"] == pytest.approx(scalars("val/accuracy")[STEPS])


def test_the_first_groups_are_train_and_val(observed):
    """TensorBoard orders tag groups alphabetically and opens the first two: the train and eval
    curves come before the images, the speed and norm curves, the histograms and the compilation
    counts (`test_tensorboard_screen` looks at them in a browser)."""
    _, workdir, _ = observed
    tags = read_events(workdir).Tags()
    kinds = ("scalars", "images", "histograms")
    groups = sorted({tag.split("/")[0] for kind in kinds for tag in tags[kind]})
    assert groups == ["train", "val", "visuals", "vitals", "weights", "xla"]


def test_profile_steps_write_a_trace_and_console_lines_reach_train_log(observed):
    _, workdir, result = observed
    (trace,) = glob.glob(str(workdir / "plugins" / "profile" / "*" / "*.xplane.pb"))
    # step markers (the Profile tab's overview needs them): step_num of each traced step
    assert b"step_num" in Path(trace).read_bytes()
    assert "Profiler trace of steps 3-5" in result.stderr
    log = (workdir / "train.log").read_text()
    for line in (f"eval @ step {STEPS}:", f"step {STEPS}/{STEPS} accuracy", "Profiler trace"):
        assert line in result.stderr and line in log, line


def test_histograms_and_profiling_leave_the_bits_alone(observed, tmp_path):
    _, workdir, _ = observed
    plain = Trainer(zoo.compose(mlp_args(tmp_path)))
    result = plain.fit()
    checkpointer = Checkpointer(workdir / "checkpoints")
    try:
        observed_state = checkpointer.restore_state(STEPS, abstract_like(plain.state))
    finally:
        checkpointer.close()
    assert_same_bits(observed_state, result.state)
    assert not (tmp_path / "plugins").exists()
    assert "histograms" not in {k for k, v in read_events(tmp_path).Tags().items() if v}


def test_events_are_readable_while_training_and_complete_after_sigterm(tmp_path):
    """A long run: its first windows are read from disk while it trains; after SIGTERM every
    window it closed is there."""
    args = ["model=xor", "trainer.steps=1000000", f"trainer.log_every={LOG_EVERY}"]
    args += ["trainer.steps_per_dispatch=1"]  # a window of log_every steps, dispatched one by one
    workdir, console = tmp_path / "run", tmp_path / "console.txt"
    with console.open("w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "zoo.train", *args, f"workdir={workdir}"],
            cwd=ROOT,
            env={**os.environ, "JAX_NUM_CPU_DEVICES": "8"},
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        live: dict[int, float] = {}
        deadline = time.monotonic() + 240
        while not live and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
            if glob.glob(str(workdir / "events.out.tfevents.*")):
                events = read_events(workdir)
                if "train/loss" in events.Tags()["scalars"]:
                    live = scalar_steps(events, "train/loss")
        running = process.poll() is None  # still training after the events were read
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    stderr = console.read_text()
    assert live and running, stderr
    assert process.returncode == 128 + signal.SIGTERM, stderr
    stopped = int(re.search(r"Stopped by SIGTERM after step (\d+)", stderr).group(1))
    assert max(live) < stopped
    losses = scalar_steps(read_events(workdir), "train/loss")
    assert list(losses) == list(range(LOG_EVERY, stopped + 1, LOG_EVERY))


def test_compile_counts_and_hparams_follow_a_resume(tmp_path):
    """A run resumed with more steps: its compile counts go on from the first process's, and
    its HParams row shows the resumed config (TensorBoard keeps a tag's first metadata)."""
    args = ("model=xor", "trainer.steps_per_dispatch=10", "trainer.log_every=10")
    for steps in (20, 40):  # the second command resumes the first's run
        result = run_cli(
            *args, f"trainer.steps={steps}", f"workdir={tmp_path}", env=NO_COMPILE_CACHE
        )
        assert result.returncode == 0, result.stderr
    events = read_events(tmp_path)
    count, seconds = (scalar_steps(events, f"xla/compile_{t}") for t in ("count", "seconds"))
    assert list(count) == [10, 20, 30, 40]
    assert count[30] > count[20] and seconds[30] > seconds[20]  # the second process's added
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    session = HParamsPluginData.FromString(content).session_start_info
    assert session.hparams[column_name("trainer.steps")].string_value == "40"


def test_gpt_text_sample_is_markdown_not_a_repr(tmp_path):
    tiny = ("model.dim=32", "model.depth=1", "model.context_length=64", "data.window=64")
    quick = ("data.eval_bytes=4096", "trainer.steps=2", "trainer.log_every=2")
    zoo.fit("gpt", *tiny, *quick, f"workdir={tmp_path}")
    (sample,) = read_events(tmp_path).Tensors("sample/text_summary")
    text = sample.tensor_proto.string_val[0].decode()
    assert text.startswith("**prompt**\n\n    ") and "\n\n**continuation**\n\n    " in text
    assert "\\n" not in text and "' -> '" not in text  # no Python repr


def test_without_eval_reports_an_eval_writes_its_metrics_and_no_sample(tmp_path):
    tiny = ("model.dim=32", "model.depth=1", "model.context_length=64", "data.window=64")
    quick = ("data.eval_bytes=4096", "trainer.steps=2", "trainer.log_every=2")
    zoo.fit("gpt", *tiny, *quick, "logging.eval_reports=false", f"workdir={tmp_path}")
    events = read_events(tmp_path)
    assert "val/loss" in events.Tags()["scalars"]
    assert not [tag for tag in events.Tags()["tensors"] if tag.startswith("sample")]

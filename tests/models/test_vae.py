"""The VAE on real digits and 8 devices: its `noise` stream advances once per step and a run
killed with SIGKILL and resumed in real subprocesses ends with the bits of an uninterrupted run;
eval is deterministic; reconstructions and samples land in TensorBoard as images."""

from __future__ import annotations

import io
import signal

import jax
import numpy as np
import pytest
from conformance.checks import planned_split
from flax import nnx
from helpers import assert_same_bits, read_events, run_and_signal, run_cli, scalar_steps
from PIL import Image
from zoo.engine.checkpoints.manager import Checkpointer
from zoo.engine.checkpoints.reader import abstract_like
from zoo.engine.loop.trainer import Trainer

import zoo
from zoo.overrides import compose

STEPS, EVERY = 160, 40


def args(workdir) -> list[str]:
    return [
        "model=vae",
        *zoo.get_model("vae").tiny,
        f"trainer.steps={STEPS}",
        "trainer.batch_size=64",
        "trainer.log_every=1",
        f"trainer.eval_every={STEPS // 2}",
        f"trainer.checkpoint_every={EVERY}",
        "trainer.keep=4",  # every checkpoint of the run
        "optimizer.warmup_steps=0",
        f"workdir={workdir}",
    ]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    trainer = Trainer(compose(args(tmp_path_factory.mktemp("vae"))))
    return trainer, trainer.fit()


def noise_count(state) -> int:
    counts = [
        int(value)
        for path, value in jax.tree.leaves_with_path(nnx.state(state, nnx.RngCount))
        if "noise" in jax.tree_util.keystr(path)
    ]
    assert len(counts) == 1, counts
    return counts[0]


def test_noise_stream_advances_once_per_step_and_resume_reproduces_it(uninterrupted, tmp_path):
    trainer, result = uninterrupted
    assert noise_count(result.state) == STEPS
    code, stderr = run_and_signal(args(tmp_path), tmp_path, STEPS // 2 + 5, signal.SIGKILL, STEPS)
    assert code == -signal.SIGKILL, stderr
    checkpointer = Checkpointer(tmp_path / "checkpoints")
    restart = max(checkpointer.all_steps())  # the step-80 save may not have finished
    checkpointer.close()
    assert EVERY <= restart < STEPS
    resumed = run_cli(*args(tmp_path), devices=8)  # the mesh the killed run had
    assert resumed.returncode == 0, resumed.stderr
    assert f"Resuming at step {restart}" in resumed.stderr
    checkpointer = Checkpointer(tmp_path / "checkpoints")
    try:
        restored = checkpointer.restore_state(STEPS, abstract_like(trainer.state))
        at_restart = checkpointer.restore_state(restart, abstract_like(trainer.state))
    finally:
        checkpointer.close()
    assert noise_count(at_restart) == restart
    assert_same_bits(restored, result.state)


def test_eval_is_deterministic_and_logs_both_parts_of_the_elbo(uninterrupted):
    trainer, result = uninterrupted
    assert trainer.evaluate() == result.eval_metrics
    metrics = result.eval_metrics
    assert metrics["loss"] == pytest.approx(metrics["reconstruction"] + metrics["kl"], rel=1e-5)
    assert metrics["kl"] > 0
    losses = scalar_steps(read_events(result.workdir), "train/loss")
    assert losses[STEPS] < 0.8 * losses[1]


def test_reconstructions_and_samples_land_in_tensorboard(uninterrupted):
    _, result = uninterrupted
    events = read_events(result.workdir)
    for tag in ("visuals/reconstructions", "visuals/samples"):
        images = events.Images(tag)
        assert [image.step for image in images] == [STEPS // 2, STEPS]
        pixels = np.asarray(Image.open(io.BytesIO(images[-1].encoded_image_string)))
        # 8 columns and 8 rows of 8x8 digits, one pixel apart: 32 images over their
        # reconstructions, or 64 samples.
        assert pixels.shape[:2] == (71, 71)
        assert pixels.std() > 10  # not a blank image


def test_encoder_and_decoder_layers_alternate_over_tensor():
    planned = planned_split("vae")
    assert {"encoder.layers.0.kernel", "decoder.layers.1.kernel", "pixels.kernel"} <= planned

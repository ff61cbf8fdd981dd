"""cnn: conv-BatchNorm-ReLU stages (stride-2 after the first), Dropout, a linear head (what
every model passes: tests/conformance/)."""

from __future__ import annotations

from conformance.checks import planned_split
from model_checks import Models, assert_batchnorm_moves_in_train_mode_only, digits


def test_output_channels_split_over_tensor():
    assert {"blocks.0.conv.kernel", "blocks.2.norm.scale"} <= planned_split("cnn")


def test_batchnorm_normalises_with_batch_statistics_in_train_mode_only():
    assert_batchnorm_moves_in_train_mode_only(Models.tiny("cnn"), digits()["image"])

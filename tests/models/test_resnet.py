"""resnet: a small-image ResNet, residual blocks with BatchNorm (what every model passes:
tests/conformance/)."""

from __future__ import annotations

import numpy as np
import pytest
from conformance.checks import assert_abstract_build_equals_the_full_trace, planned_split
from model_checks import Models, assert_batchnorm_moves_in_train_mode_only, digits


@pytest.fixture(scope="module")
def models():
    return Models.tiny("resnet")


def test_blocks_start_as_the_identity_and_channels_split_over_tensor(models):
    assert {"stem.kernel", "blocks.1.conv2.kernel", "head.kernel"} <= planned_split("resnet")
    for block in models.split.blocks:  # the second norm's scale starts at zero
        assert not np.asarray(block.norm2.scale[...]).any()


def test_batchnorm_normalises_with_batch_statistics_in_train_mode_only(models):
    assert_batchnorm_moves_in_train_mode_only(models, digits()["image"])


@pytest.mark.parametrize(
    "stages",
    [["model.stage_sizes=[2,3]"], ["model.block=bottleneck", "model.stage_sizes=[3,1]"]],
    ids=["basic", "bottleneck"],
)
def test_an_abstract_build_of_deeper_stages_equals_the_full_trace(stages):
    """Stages of several blocks, whose blocks after the first an abstract build clones."""
    assert_abstract_build_equals_the_full_trace("resnet", *stages)

"""Tensors in torch's layout <-> zoo's, for the checkpoint families of the vision models: a
convolution kernel (out, in, h, w) <-> (h, w, in, out), with timm's adaptation of a 3-channel
input layer to a 1-channel model (the kernel summed over its input channels)."""

from __future__ import annotations

import numpy as np


def conv_load(w: np.ndarray) -> tuple[np.ndarray]:
    return (w.transpose(2, 3, 1, 0),)


def conv_save(kernel: np.ndarray) -> np.ndarray:
    return kernel.transpose(3, 2, 0, 1)


def input_conv_load(channels: int):
    """The load of a model's first convolution for `channels` inputs: a 3-channel kernel is
    summed over its inputs for a 1-channel model (timm's `adapt_input_conv`), else kept."""

    def load(w: np.ndarray) -> tuple[np.ndarray]:
        if channels == 1 and w.shape[1] == 3:
            w = w.sum(axis=1, keepdims=True)
        return conv_load(w)

    return load


def linear_load(w: np.ndarray) -> tuple[np.ndarray]:
    return (w.T,)


def linear_save(kernel: np.ndarray) -> np.ndarray:
    return kernel.T

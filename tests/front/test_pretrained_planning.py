"""`zoo.load` of a pretrained directory plans the model from its config.json and copies the
tensors while the config is composed; where the checkpoint leaves a size to the data set, the
model is the composed config's all the same."""

from __future__ import annotations

import json
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file
from zoo.engine import registry
from zoo.engine.registry import Family, Rule, register_family
from zoo.engine.weights import pretrained as weights
from zoo.models.xor import binary_classification_loss

import zoo
from zoo.loading import checkpoint_hparams, plan_pretrained

CLASSES, SIZE = 3, 2
"""What the data sets' config decides by default."""


class Picker(nnx.Module):
    def __init__(
        self,
        num_classes: int | None = None,
        input_shape: tuple[int, ...] | None = None,
        *,
        rngs: nnx.Rngs,
    ):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
        self.head = nnx.Linear(2, num_classes, kernel_init=init, rngs=rngs)
        self.input_size = input_shape[0]

    def __call__(self, x):
        return self.head(x)


def picked(classes: int = CLASSES, size: int = SIZE) -> registry.Splits:
    raise AssertionError("loading a checkpoint reads no data")


def register(name: str, describe, **info) -> str:
    """A model whose checkpoints say nothing of its sizes, and its default data set, whose
    config decides them (`describe`; `info`: what it says without a config)."""
    if name in zoo.list_models():
        return name
    zoo.register_data(f"{name}-data", picked, describe=describe, **info)
    zoo.register_model(name, Picker, loss=binary_classification_loss, default_data=f"{name}-data")
    register_family(
        Family(
            name=f"{name}-ckpt",
            model=name,
            matches=lambda config: config.get("model_type") == f"{name}-ckpt",
            hparams=lambda config: {},
            rules=[
                Rule(r"head\.weight", ("head.kernel",), load=lambda w: (w.T,), save=np.transpose),
                Rule(r"head\.bias", ("head.bias",)),
            ],
        )
    )
    return name


def open_data(classes, size):
    return {"num_classes": classes, "input_shape": (size,)}


def other_data(classes, size):
    return {"input_shape": (size,)}


MODELS = {
    # The checkpoint leaves the classes to the data set: planned after composition.
    "leaves-the-classes": lambda: register("picker-open", open_data),
    # The data set says 5 inputs without a config and 2 with its default one: a plan from the
    # checkpoint fits the weights, but is not the composed config's model.
    "the-config-decides-otherwise": lambda: register(
        "picker-other", other_data, num_classes=CLASSES, input_shape=(5,)
    ),
}


@pytest.mark.parametrize("model", MODELS)
def test_the_model_is_the_composed_config_s(tmp_path, model):
    tensors = checkpoint(tmp_path, MODELS[model]())

    loaded = zoo.load(tmp_path)

    assert loaded.model.input_size == SIZE
    np.testing.assert_array_equal(loaded.model.head.kernel[...], tensors["head.weight"].T)
    np.testing.assert_array_equal(loaded.model.head.bias[...], tensors["head.bias"])


def test_a_checkpoint_that_implies_its_sizes_is_planned_from_them(tmp_path):
    checkpoint(tmp_path, MODELS["the-config-decides-otherwise"]())
    hparams = checkpoint_hparams(weights.open_pretrained(tmp_path))
    assert (hparams["num_classes"], hparams["input_shape"]) == (CLASSES, [5])


def test_the_copies_end_with_the_body_and_the_switch_interval_comes_back(tmp_path):
    tensors = checkpoint(tmp_path, MODELS["the-config-decides-otherwise"]())
    pretrained = weights.open_pretrained(tmp_path)
    hparams = checkpoint_hparams(pretrained)
    planned = plan_pretrained(pretrained, hparams, None, jax.devices()[:1])
    fill = planned.plan_fill()
    before = sys.getswitchinterval()
    with pytest.raises(RuntimeError, match="the body failed"), fill.copied_meanwhile():
        assert sys.getswitchinterval() < before
        raise RuntimeError("the body failed")
    assert sys.getswitchinterval() == before
    model = planned.finish(fill)
    np.testing.assert_array_equal(model.head.bias[...], tensors["head.bias"])


def test_the_copies_wait_until_the_pages_are_in(tmp_path):
    """The pages of a load's buffers are faulted in by writing to them on a thread of their
    own: no copy may go into a buffer before that thread is done."""
    tensors = checkpoint(tmp_path, MODELS["the-config-decides-otherwise"]())
    pretrained = weights.open_pretrained(tmp_path)
    planned = plan_pretrained(pretrained, checkpoint_hparams(pretrained), None, jax.devices()[:1])
    fill = planned.plan_fill()
    assert fill.ready == planned.memory.wait
    buffers_when_ready = []

    def ready():
        planned.memory.wait()
        buffers_when_ready.append([f.buffer.copy() for f in fill.fillings.values()])

    fill.ready = ready
    fill.copy()
    assert len(buffers_when_ready) == 1
    assert not any(buffer.any() for buffer in buffers_when_ready[0])
    model = planned.finish(fill)
    np.testing.assert_array_equal(model.head.kernel[...], tensors["head.weight"].T)


def checkpoint(directory, name: str) -> dict[str, np.ndarray]:
    """A checkpoint of model `name` with `CLASSES` classes in `directory`; its tensors."""
    rng = np.random.default_rng(0)
    tensors = {"head.weight": rng.normal(size=(CLASSES, 2)), "head.bias": rng.normal(size=CLASSES)}
    tensors = {key: value.astype(np.float32) for key, value in tensors.items()}
    save_file(tensors, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps({"model_type": f"{name}-ckpt"}))
    return tensors

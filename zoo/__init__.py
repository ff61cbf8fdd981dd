"""zoo: a Flax NNX model zoo.

import zoo
zoo.list_models()                      # ['cnn', 'gpt', 'mlp', 'resnet', 'vae', 'vit', 'xor']
model = zoo.create_model("xor", num_hidden=16)
result = zoo.run(zoo.compose(["model=xor", "trainer.steps=500"]))
"""

import data  # noqa: F401  (registers the built-in data sets)
import models  # noqa: F401  (registers the built-in models)
from models.generate import generate
from train.loop import NonFiniteLoss, RunResult, run
from train.signals import Interrupted
from zoo.config import compose
from zoo.errors import ZooError
from zoo.registry import (
    ModelEntry,
    Splits,
    create_model,
    get_model,
    list_datasets,
    list_models,
    register_data,
    register_model,
)

__all__ = [
    "Interrupted",
    "ModelEntry",
    "NonFiniteLoss",
    "RunResult",
    "Splits",
    "ZooError",
    "compose",
    "create_model",
    "generate",
    "get_model",
    "list_datasets",
    "list_models",
    "register_data",
    "register_model",
    "run",
]

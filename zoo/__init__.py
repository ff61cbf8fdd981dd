"""zoo: a Flax NNX model zoo.

import zoo
zoo.list_models()                      # ['cnn', 'gpt', 'mlp', 'resnet', 'vae', 'vit', 'xor']
model = zoo.create_model("xor", num_hidden=16)
result = zoo.fit("cnn", "data=digits")              # the CLI's job, from Python
trained = zoo.load(result.workdir)                  # a run's model, weights and config
tuned = zoo.finetune(trained, data=zoo.Splits(train=..., eval=...), num_classes=5,
                     replace_head=True, freeze="backbone")   # a new head on a frozen backbone

The package is the top of three layers: `zoo` (command line, Hydra composition, this API) uses
the plugins `models` and `data`, which use the engine `train`; nothing below imports upwards.
"""

import data  # noqa: F401  (registers the built-in data sets)
import models  # noqa: F401  (registers the built-in models)
from models.generate import generate
from train.errors import NonFiniteLoss, ZooError
from train.loop import RunResult
from train.registry import (
    ModelEntry,
    Splits,
    get_model,
    list_datasets,
    list_models,
    register_data,
    register_model,
)
from train.signals import Interrupted
from zoo.api import (
    TrainedModel,
    create_model,
    evaluate,
    fit,
    load,
    load_data,
    merge_lora,
    predict,
    run,
)
from zoo.overrides import compose
from zoo.tuning import finetune

__all__ = [
    "Interrupted",
    "ModelEntry",
    "NonFiniteLoss",
    "RunResult",
    "Splits",
    "TrainedModel",
    "ZooError",
    "compose",
    "create_model",
    "evaluate",
    "finetune",
    "fit",
    "generate",
    "get_model",
    "list_datasets",
    "list_models",
    "load",
    "load_data",
    "merge_lora",
    "predict",
    "register_data",
    "register_model",
    "run",
]

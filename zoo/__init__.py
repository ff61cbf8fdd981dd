"""zoo: a Flax NNX model zoo.

    import zoo
    zoo.list_models()                      # ['cnn', 'gpt', 'mlp', 'resnet', 'vae', 'vit', 'xor']
    zoo.list_models(families=True)         # {'gpt': ['gpt2: GPT-2, ...'], ...}: checkpoints loaded
    model = zoo.create_model("xor", num_hidden=16)
    result = zoo.fit("cnn", "data=digits")              # the CLI's job, from Python
    trained = zoo.load(result.workdir)                  # a run's model, weights and config
    tuned = zoo.finetune(trained, data=zoo.Splits(train=..., eval=...), num_classes=5,
                         replace_head=True, freeze="backbone")   # a new head on a frozen backbone
    gpt2 = zoo.load("gpt2")                             # a pretrained checkpoint directory
    zoo.export(result.workdir, "out", format="hf")      # back to the checkpoint family's layout
    text = zoo.generate(gpt2, "Hello", max_new_tokens=20)  # through the model's tokenizer
    zoo.evaluate_lm(gpt2, "hellaswag", limit=100)      # lm-evaluation-harness tasks (zoo[eval])

zoo is one import name in three layers: the front (command line, Hydra composition, this API)
uses the plugins `zoo.models` and `zoo.data`, which use the engine `zoo.engine`; nothing below
imports upwards.
"""

# `zoo.export` and `zoo.generate` name both a command line (a package) and a function. Python
# binds a package to its parent's attribute when it first imports it: the packages are imported
# here, before the functions are bound below, so that a later `import zoo.generate` (or
# `python -m zoo.generate`) finds them imported and leaves `zoo.generate` the function.
import zoo.data  # registers the built-in data sets
import zoo.export
import zoo.generate
import zoo.models  # noqa: F401  (registers the built-in models)
from zoo.engine.errors import NonFiniteLoss, ZooError
from zoo.engine.loop import STOP, CallbackFailed, CallbackStop, Interrupted, RunResult
from zoo.engine.registry import (
    ModelEntry,
    Splits,
    get_model,
    list_datasets,
    register_data,
    register_model,
)
from zoo.evaluation import evaluate
from zoo.exporting import export
from zoo.finetuning import finetune
from zoo.lm_evaluation import LMEvalCallback, evaluate_lm
from zoo.loading import load
from zoo.overrides import compose
from zoo.predicting import predict
from zoo.pretrained import list_models
from zoo.registered import create_model, load_data
from zoo.text_generation import generate
from zoo.trained import TrainedModel, merge_lora
from zoo.training import fit, run

__all__ = [
    "STOP",
    "CallbackFailed",
    "CallbackStop",
    "Interrupted",
    "LMEvalCallback",
    "ModelEntry",
    "NonFiniteLoss",
    "RunResult",
    "Splits",
    "TrainedModel",
    "ZooError",
    "compose",
    "create_model",
    "evaluate",
    "evaluate_lm",
    "export",
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

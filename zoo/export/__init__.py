"""Writing a trained model out: `zoo.export(workdir, out_dir, format="hf" | "jax")`, and its CLI
`python -m zoo.export WORKDIR OUT [format=hf|jax] [step=latest] [weights=raw|ema]`.

- `hf`: `config.json` + `model.safetensors` (+ `tokenizer.json`) in the layout of the checkpoint
  family the model loads (the one the run started from, else the model's first), which that
  family's reference code reads; LoRA adapters are merged first. Generic over every registered
  family: the family's key table, run backwards (`zoo.engine.weights.export_tensors`). A ViT trained
  at another image size than its checkpoint's is written with its positions resized to the
  images it takes, as each call resizes them, so that the config names that size; a language
  model's config names its end-of-text token (`zoo.export.token_ids`).
- `jax`: the inference function serialised with `jax.export` (StableHLO) in `model.jaxexport`,
  its weights in `weights.npz` (in the order the function takes them) and `signature.json`; a
  process with jax alone runs it: `jax.export.deserialize(...).call(*weights, inputs)`.

(`zoo.export` is the function once `import zoo` ran; the package's `__main__` is the CLI, so
`python -m zoo.export` does not run this module a second time.)
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import jax
import numpy as np
from flax import nnx

from zoo.api import TrainedModel, load, resolved_hparams
from zoo.engine import registry
from zoo.engine import weights as pretrained
from zoo.engine.errors import ZooError
from zoo.engine.lora import merge_adapters
from zoo.export.token_ids import special_token_ids

FORMATS = ("hf", "jax")
FUNCTION, WEIGHTS, SIGNATURE = "model.jaxexport", "weights.npz", "signature.json"


def export(
    workdir: str | os.PathLike,
    out_dir: str | os.PathLike,
    format: str = "hf",
    step="latest",
    weights: str = "raw",
) -> str:
    """Write the model of the run (or pretrained directory) `workdir` at `step` into `out_dir`
    as `format` (`hf` or `jax`, see the module docstring); returns `out_dir`'s path.
    `weights="ema"` writes the average of the params that `optimizer.ema_decay` kept (as
    `zoo.load(..., weights="ema")` loads it) in place of the params themselves."""
    if format not in FORMATS:
        raise ZooError(f"format={format!r} is not an export format: choose one of hf, jax.")
    trained = load(workdir, step, devices=jax.devices()[:1], weights=weights)
    with trained.activate():
        merge_adapters(trained.model)
    out = os.path.abspath(os.fspath(out_dir))
    return _hf(trained, out) if format == "hf" else _jax(trained, out)


def _family(trained: TrainedModel) -> registry.Family:
    name, start = trained.config.model.name, trained.config.finetune.init_from
    if start and pretrained.is_pretrained(start):
        return pretrained.open_pretrained(start, name).family
    found = [f for f in registry.families(name) if f.export_config is not None]
    if not found:
        raise ZooError(
            f"Model '{name}' loads no checkpoint family with an export layout, so format=hf "
            "has no layout to write; use format=jax."
        )
    return found[0]


def _hf(trained: TrainedModel, out: str) -> str:
    family, hparams = _family(trained), resolved_hparams(trained.config)
    if hasattr(trained.model, "hold_positions_at_input_size"):
        with trained.activate():
            hparams["position_grid"] = list(trained.model.hold_positions_at_input_size())
    tensors = pretrained.export_tensors(trained.model, family, hparams)
    config = family.export_config(hparams)
    tokenizer = trained.config.data.get("tokenizer")
    if tokenizer and os.path.isdir(tokenizer):
        tokenizer = os.path.join(tokenizer, pretrained.TOKENIZER)
    if "vocab_size" in config:
        config.update(special_token_ids(tokenizer, config["vocab_size"]))
    pretrained.write_pretrained(out, config, tensors)
    if tokenizer:
        shutil.copyfile(tokenizer, os.path.join(out, pretrained.TOKENIZER))
    return out


def _jax(trained: TrainedModel, out: str) -> str:
    graphdef, state = nnx.split(trained.model)
    leaves, treedef = jax.tree.flatten(state)
    example = _example_input(trained)

    def infer(leaves, inputs):
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))(inputs)

    with trained.activate():
        exported = jax.export.export(jax.jit(infer))(leaves, example)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, FUNCTION), "wb") as f:
        f.write(exported.serialize())
    arrays = {f"{i:05d}": np.asarray(jax.device_get(leaf)) for i, leaf in enumerate(leaves)}
    np.savez(os.path.join(out, WEIGHTS), **arrays)
    signature = {"inputs": {"shape": list(example.shape), "dtype": str(example.dtype)}}
    with open(os.path.join(out, SIGNATURE), "w", encoding="utf-8") as f:
        json.dump(signature, f, indent=2)
    return out


def _example_input(trained: TrainedModel) -> jax.ShapeDtypeStruct:
    """One example's inputs: a sequence of `context_length` token ids, or an image."""
    hparams = resolved_hparams(trained.config)
    if hparams.get("input_shape"):
        return jax.ShapeDtypeStruct((1, *hparams["input_shape"]), np.float32)
    if hparams.get("context_length"):
        return jax.ShapeDtypeStruct((1, hparams["context_length"]), np.int32)
    raise ZooError(f"Cannot tell the inputs of model '{trained.config.model.name}' to export.")


def main(argv: list[str]) -> int:
    positional = [a for a in argv if "=" not in a]
    options = dict(a.split("=", 1) for a in argv if "=" in a)
    unknown = sorted(set(options) - {"format", "step", "weights"})
    if len(positional) != 2 or unknown:
        print(
            "usage: python -m zoo.export WORKDIR OUT_DIR [format=hf|jax] [step=latest|best|N] "
            "[weights=raw|ema]",
            file=sys.stderr,
        )
        return 2
    try:
        out = export(*positional, **options)
    except ZooError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0

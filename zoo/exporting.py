"""`zoo.export(workdir, out_dir, format="hf" | "jax")`: a trained model written out for
programs other than zoo. The command line: `python -m zoo.export` (`zoo/export/`).

- `hf`: `config.json` + `model.safetensors` in the layout of the checkpoint family the model
  loads (the one the run started from, else the model's first whose layout holds its
  settings: a `decoder` trained from scratch is written as a Llama), which that family's
  reference code reads; LoRA adapters are merged first. Generic over every registered family: the
  family's key table, run backwards (`zoo.engine.weights.export_tensors`). The weights are
  written in `dtype` (`float32` or `bfloat16`), split into shards listed by
  `model.safetensors.index.json` above `max_shard_size` (`"5GB"`, as transformers takes it).
  The tokenizer comes along: the one the run trained with (`data.tokenizer`), and, from the
  pretrained directory the run started from (`finetune.init_from`), its tokenizer settings,
  chat template and generation config (`zoo.hf_export.CARRIED`), unless the run trained with
  another tokenizer. A vision family's image-processor settings (`preprocessor_config.json`)
  are written from the model's normalisation. A ViT trained at another image size than its
  checkpoint's is written with its positions resized to the images it takes, as each call
  resizes them, so that the config names that size; a language model's config names its
  end-of-text token (`zoo.hf_export.special_token_ids`).
- `jax`: the inference function serialised with `jax.export` (StableHLO) in `model.jaxexport`
  (a language model's logits over its vocabulary alone, as `zoo.predict` gives them),
  its weights in `weights.npz` (in the order the function takes them) and `signature.json`; a
  process with jax alone runs it: `jax.export.deserialize(...).call(*weights, inputs)`.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from flax import nnx

from zoo.engine import weights as pretrained
from zoo.engine.errors import ZooError
from zoo.engine.weights import merge_adapters
from zoo.hf_export import write_hf
from zoo.loading import load
from zoo.predicting import within_vocabulary
from zoo.trained import TrainedModel, resolved_hparams

FORMATS = ("hf", "jax")
FUNCTION, WEIGHTS, SIGNATURE = "model.jaxexport", "weights.npz", "signature.json"


def export(
    workdir: str | os.PathLike,
    out_dir: str | os.PathLike,
    format: str = "hf",
    step="latest",
    weights: str = "raw",
    dtype: str = "float32",
    max_shard_size: int | str | None = None,
) -> str:
    """Write the model of the run (or pretrained directory) `workdir` at `step` into `out_dir`
    as `format` (`hf` or `jax`, see `zoo.exporting`); returns `out_dir`'s path.
    `weights="ema"` writes the average of the params that `optimizer.ema_decay` kept (as
    `zoo.load(..., weights="ema")` loads it) in place of the params themselves. For `hf`:
    `dtype` (`float32` or `bfloat16`) is the weights' dtype in the files, and
    `max_shard_size` (bytes, or `"200MB"`, `"5GB"`, `"2GiB"`) splits them into shards above
    that size."""
    if format not in FORMATS:
        raise ZooError(f"format={format!r} is not an export format: choose one of hf, jax.")
    if format != "hf" and (dtype != "float32" or max_shard_size is not None):
        raise ZooError(
            f"dtype={dtype!r} and max_shard_size={max_shard_size!r} are options of format=hf; "
            "format=jax writes the params as the model holds them."
        )
    if dtype not in pretrained.DTYPES:
        raise ZooError(f"dtype={dtype!r}: format=hf writes {' or '.join(pretrained.DTYPES)}.")
    trained = load(workdir, step, devices=jax.devices()[:1], weights=weights)
    with trained.activate():
        merge_adapters(trained.model)
    out = os.path.abspath(os.fspath(out_dir))
    if format == "jax":
        return _jax(trained, out)
    return write_hf(trained, out, dtype=dtype, max_shard_size=max_shard_size)


def _jax(trained: TrainedModel, out: str) -> str:
    graphdef, state = nnx.split(trained.model)
    leaves, treedef = jax.tree.flatten(state)
    example = _example_input(trained)

    def infer(leaves, inputs):
        model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
        return within_vocabulary(model, model(inputs))

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

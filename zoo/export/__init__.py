"""Writing a trained model out: `zoo.export(workdir, out_dir, format="hf" | "jax")`, and its CLI
`python -m zoo.export WORKDIR OUT [format=hf|jax] [step=latest] [weights=raw|ema]
[dtype=float32|bfloat16] [max_shard_size=SIZE]`.

- `hf`: `config.json` + `model.safetensors` in the layout of the checkpoint family the model
  loads (the one the run started from, else the model's first whose layout holds its
  settings: a `decoder` trained from scratch is written as a Llama), which that family's
  reference code reads; LoRA adapters are merged first. Generic over every registered family: the
  family's key table, run backwards (`zoo.engine.weights.export_tensors`). The weights are
  written in `dtype` (`float32` or `bfloat16`), split into shards listed by
  `model.safetensors.index.json` above `max_shard_size` (`"5GB"`, as transformers takes it).
  The tokenizer comes along: the one the run trained with (`data.tokenizer`), and, from the
  pretrained directory the run started from (`finetune.init_from`), its tokenizer settings,
  chat template and generation config (`CARRIED`), unless the run trained with another
  tokenizer. A vision family's image-processor settings (`preprocessor_config.json`) are
  written from the model's normalisation. A ViT trained at another image size than its
  checkpoint's is written with its positions resized to the images it takes, as each call
  resizes them, so that the config names that size; a language model's config names its
  end-of-text token (`zoo.export.token_ids`).
- `jax`: the inference function serialised with `jax.export` (StableHLO) in `model.jaxexport`
  (a language model's logits over its vocabulary alone, as `zoo.predict` gives them),
  its weights in `weights.npz` (in the order the function takes them) and `signature.json`; a
  process with jax alone runs it: `jax.export.deserialize(...).call(*weights, inputs)`.

(`zoo.export` is the function once `import zoo` ran; the package's `__main__` is the CLI, so
`python -m zoo.export` does not run this module a second time.)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from typing import Any

import jax
import numpy as np
from flax import nnx

from zoo.api import TrainedModel, load, resolved_hparams, within_vocabulary
from zoo.cli import load_plugins
from zoo.engine import registry
from zoo.engine import weights as pretrained
from zoo.engine.errors import ZooError
from zoo.engine.weights import merge_adapters
from zoo.export.token_ids import special_token_ids
from zoo.pretrained import run_tokenizer

log = logging.getLogger("zoo")
FORMATS = ("hf", "jax")
FUNCTION, WEIGHTS, SIGNATURE = "model.jaxexport", "weights.npz", "signature.json"
CARRIED = (
    pretrained.TOKENIZER,
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
"""The files of a pretrained directory that a run from it carries into its export: the
tokenizer and its settings, the chat template and the generation config."""


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
    as `format` (`hf` or `jax`, see the module docstring); returns `out_dir`'s path.
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
    return _hf(trained, out, dtype=dtype, max_shard_size=max_shard_size)


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
    hparams, refusals = resolved_hparams(trained.config), []
    for family in found:  # the first whose layout holds this model's settings
        try:
            family.export_config(hparams)
        except ZooError as e:
            refusals.append(f"{family.name}: {e}")
            continue
        return family
    raise ZooError(
        f"No checkpoint family of model '{name}' has a layout that holds this model's "
        f"settings, so format=hf cannot write it; use format=jax. {' '.join(refusals)}"
    )


def _hf(trained: TrainedModel, out: str, **writing: Any) -> str:
    family, hparams = _family(trained), resolved_hparams(trained.config)
    if hasattr(trained.model, "hold_positions_at_input_size"):
        with trained.activate():
            hparams["position_grid"] = list(trained.model.hold_positions_at_input_size())
    tensors = pretrained.export_tensors(trained.model, family, hparams)
    config = family.export_config(hparams)
    carried = carried_files(trained.config, trained.workdir)
    if "vocab_size" in config:
        config.update(special_token_ids(carried.get(pretrained.TOKENIZER), config["vocab_size"]))
    pretrained.write_pretrained(out, config, tensors, sidecars=family.sidecars, **writing)
    for name, path in carried.items():
        shutil.copyfile(path, os.path.join(out, name))
    return out


def carried_files(config: Any, workdir: str | None = None) -> dict[str, str]:
    """File name -> path of what an export of the run of `config` carries beside the weights:
    the tokenizer it trained with (`data.tokenizer`, or where that is gone the copy the run
    kept in its `workdir`) and what the pretrained directory it started from holds of
    `CARRIED`; only the former where the two tokenizers differ (the directory's settings are
    its own tokenizer's)."""
    start = config.finetune.get("init_from")
    source = start if start and pretrained.is_pretrained(start) else None
    if start and not os.path.exists(start):
        log.warning(
            "The run started from %s, which is gone: the export carries no tokenizer settings, "
            "chat template or generation config of it.",
            start,
        )
    found = {
        name: os.path.join(source, name)
        for name in (CARRIED if source else ())
        if os.path.isfile(os.path.join(source, name))
    }
    tokenizer = run_tokenizer(config, workdir)
    if not tokenizer:
        return found
    own = found.get(pretrained.TOKENIZER)
    if own is None or not os.path.samefile(own, tokenizer):
        return {pretrained.TOKENIZER: tokenizer}
    return found


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


def main(argv: list[str]) -> int:
    positional = [a for a in argv if "=" not in a]
    options = dict(a.split("=", 1) for a in argv if "=" in a)
    unknown = sorted(set(options) - {"format", "step", "weights", "dtype", "max_shard_size"})
    if len(positional) != 2 or unknown:
        print(
            "usage: python -m zoo.export WORKDIR OUT_DIR [format=hf|jax] [step=latest|best|N] "
            "[weights=raw|ema] [dtype=float32|bfloat16] [max_shard_size=SIZE]",
            file=sys.stderr,
        )
        return 2
    try:
        load_plugins()
        out = export(*positional, **options)
    except ZooError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0

"""What the Hugging Face `config.json` files that zoo's checkpoint families write share: a
transformer's sizes, GELU and LayerNorm epsilon under the family's own key names, without
dropout, and the class labels of a classifier."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def transformer_config(
    hparams: Mapping[str, Any], keys: Sequence[str], tanh: str, dropouts: Sequence[str]
) -> dict[str, Any]:
    """The transformer's width, depth, heads, MLP width, activation and epsilon under `keys`
    (the family's names, in that order): exact GELU as `gelu`, the tanh approximation as the
    family's `tanh`; each of `dropouts` zero (zoo's exports are for inference and fine-tuning
    as zoo trains them)."""
    width, depth, heads, mlp, activation, epsilon = keys
    return {
        width: hparams["dim"],
        depth: hparams["depth"],
        heads: hparams["num_heads"],
        mlp: hparams["dim"] * hparams["mlp_ratio"],
        activation: "gelu" if hparams["exact_gelu"] else tanh,
        epsilon: hparams["norm_epsilon"],
        **dict.fromkeys(dropouts, 0.0),
    }


def class_labels(num_classes: int) -> dict[str, dict]:
    """`id2label` and `label2id` of a classifier with `num_classes` unnamed classes."""
    names = {i: f"LABEL_{i}" for i in range(num_classes)}
    return {
        "id2label": {str(i): name for i, name in names.items()},
        "label2id": {name: i for i, name in names.items()},
    }

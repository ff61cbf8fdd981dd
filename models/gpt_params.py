"""GPT-2 checkpoints (Hugging Face transformers' `GPT2LMHeadModel`) for `gpt`.

GPT-2 is `gpt` with attention biases, LayerNorm epsilon 1e-5, tanh GELU and tied embeddings.
Its `Conv1D` layers store weights as (in, out), as `nnx.Linear` does, so no transpose: the fused
`c_attn` is split into query, key and value and each reshaped to heads; `wte`'s rows are padded
to the model's padded vocabulary. Keys come with the `transformer.` prefix (a saved
`GPT2LMHeadModel`) or without (a saved `GPT2Model`, like the original `gpt2` upload); the causal
mask buffers (`attn.bias`, `attn.masked_bias`) and the tied `lm_head.weight` are not params.
With `scan_layers`, layer i's keys fill slice i of the stacked blocks' params.

Every key of GPT-2's `config.json` is accounted for (`Family.honoured`, `inert`): the sizes, the
activation, the epsilon and the attention's scale (`scale_attn_weights`,
`scale_attn_by_inverse_layer_idx`) are honoured; `tie_word_embeddings=false` (a separate output
layer that the family does not map) is refused; dropout rates, the sequence-summary head's
settings of `GPT2DoubleHeadsModel`, the old `n_ctx` and `reorder_and_upcast_attn` (transformers'
eager attention in float32, the same function: zoo's softmax is always in float32) are inert.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from zoo.models.hf_config import transformer_config
from zoo.models.language_model import padded_vocab

from zoo.plugin import Family, Rule, ZooError, register_family

_PREFIX = r"(?:transformer\.)?"
_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
_ACTIVATIONS = (*_TANH, "gelu")
_SIZE_KEYS = ("n_embd", "n_layer", "n_head", "n_inner", "activation_function", "layer_norm_epsilon")
_DROPOUTS = ("resid_pdrop", "embd_pdrop", "attn_pdrop")
_HONOURED = (
    *_SIZE_KEYS,
    "n_positions",
    "vocab_size",
    "tie_word_embeddings",
    "scale_attn_weights",
    "scale_attn_by_inverse_layer_idx",
)
_INERT = (
    *_DROPOUTS,
    "n_ctx",
    "reorder_and_upcast_attn",
    "summary_activation",
    "summary_first_dropout",
    "summary_proj_to_labels",
    "summary_type",
    "summary_use_proj",
    "id2label",
)


def _is_gpt2(config: Mapping[str, Any]) -> bool:
    return config.get("model_type") == "gpt2"


def _hparams(config: Mapping[str, Any]) -> dict[str, Any]:
    dim = int(config["n_embd"])
    inner = config.get("n_inner") or 4 * dim
    activation = config.get("activation_function", "gelu_new")
    if inner % dim or activation not in _ACTIVATIONS:
        raise ZooError(
            f"This GPT-2 config has n_inner={inner} and activation_function={activation!r}; "
            f"gpt loads an MLP width that is a multiple of n_embd={dim} and an activation among "
            f"{', '.join(_ACTIVATIONS)}."
        )
    if not config.get("tie_word_embeddings", True):
        raise ZooError(
            "This GPT-2 config has tie_word_embeddings=false (an output layer of its own, "
            "lm_head.weight): the gpt2 family loads GPT-2's tied output layer, "
            "tie_word_embeddings=true."
        )
    return {
        "context_length": int(config["n_positions"]),
        "dim": dim,
        "depth": int(config["n_layer"]),
        "num_heads": int(config["n_head"]),
        "mlp_ratio": inner // dim,
        "vocab_size": int(config["vocab_size"]),
        "tie_embeddings": True,
        "attention_bias": True,
        "norm_epsilon": float(config.get("layer_norm_epsilon", 1e-5)),
        "exact_gelu": activation == "gelu",
        "scale_attention": bool(config.get("scale_attn_weights", True)),
        "scale_attention_by_layer": bool(config.get("scale_attn_by_inverse_layer_idx", False)),
    }


def _export_config(hparams: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": hparams["vocab_size"],
        "n_positions": hparams["context_length"],
        **transformer_config(hparams, _SIZE_KEYS, "gelu_new", _DROPOUTS),
        "tie_word_embeddings": True,
        "scale_attn_weights": bool(hparams.get("scale_attention", True)),
        "scale_attn_by_inverse_layer_idx": bool(hparams.get("scale_attention_by_layer", False)),
    }


def _rules(hparams: Mapping[str, Any]) -> list[Rule]:
    dim, heads, vocab = hparams["dim"], hparams["num_heads"], hparams["vocab_size"]
    to_heads = (heads, dim // heads)

    def rule(key: str, param: str, **transform: Any) -> Rule:
        pattern = _PREFIX + key.replace(".", r"\.")
        return Rule(pattern, (param,), export_key=f"transformer.{key}", **transform)

    def block(key: str, param: str, **transform: Any) -> Rule:
        return Rule(
            _PREFIX + r"h\.(\d+)\." + key.replace(".", r"\."),
            tuple(rf"blocks.\1.{p}" for p in param.split()),
            export_key=rf"transformer.h.\1.{key}",
            **transform,
        )

    def norm(key: str, module: str, prefix=block) -> list[Rule]:
        return [prefix(f"{key}.weight", f"{module}.scale"), prefix(f"{key}.bias", f"{module}.bias")]

    qkv = "attention.query.{0} attention.key.{0} attention.value.{0}"
    return [
        rule("wte.weight", "embedding", pad_rows=padded_vocab(vocab) - vocab),
        rule("wpe.weight", "positions"),
        *norm("ln_1", "attention_norm"),
        block(
            "attn.c_attn.weight",
            qkv.format("kernel"),
            load=lambda w: tuple(part.reshape(dim, *to_heads) for part in np.split(w, 3, axis=1)),
            save=lambda *parts: np.concatenate([p.reshape(dim, dim) for p in parts], axis=1),
        ),
        block(
            "attn.c_attn.bias",
            qkv.format("bias"),
            load=lambda b: tuple(part.reshape(to_heads) for part in np.split(b, 3)),
            save=lambda *parts: np.concatenate([p.reshape(dim) for p in parts]),
        ),
        block(
            "attn.c_proj.weight",
            "attention.out.kernel",
            load=lambda w: (w.reshape(*to_heads, dim),),
            save=lambda kernel: kernel.reshape(dim, dim),
        ),
        block("attn.c_proj.bias", "attention.out.bias"),
        *norm("ln_2", "mlp_norm"),
        block("mlp.c_fc.weight", "mlp_in.kernel"),
        block("mlp.c_fc.bias", "mlp_in.bias"),
        block("mlp.c_proj.weight", "mlp_out.kernel"),
        block("mlp.c_proj.bias", "mlp_out.bias"),
        *norm("ln_f", "norm", prefix=rule),
    ]


GPT2 = register_family(
    Family(
        name="gpt2",
        model="gpt",
        matches=_is_gpt2,
        hparams=_hparams,
        rules=_rules,
        ignore=(_PREFIX + r"h\.\d+\.attn\.(?:bias|masked_bias)", r"lm_head\.weight"),
        export_config=_export_config,
        description="GPT-2, transformers GPT2LMHeadModel",
        stacked=lambda hparams: ("blocks",) if hparams.get("scan_layers") else (),
        honoured=_HONOURED,
        inert=_INERT,
    )
)

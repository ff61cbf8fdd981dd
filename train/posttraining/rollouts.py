"""`finetune.method=grpo`: each step's training batch, made from a batch of prompts by the
policy itself. Per prompt, `num_generations` completions are sampled with the model's own
sampler (`zoo.engine.registry.Sample`: the model as the trainer holds it, LoRA adapters in
place, nothing merged), decoded, scored by the reward functions on the host
(`zoo.engine.posttraining.rewards`), and turned into group-normalised advantages
(`group_advantages`). The batch the step trains on holds, per completion, the prompt and the
completion end to end (`tokens`, `length`), the mask of the completion's tokens (its
end-of-turn token included), its advantage, and, as `logged/...` columns of one value per
batch, what the run reports of the sampling: rewards per function, total, spread, lengths.

The draws come from a key folded from the run's seed and the step, so a resumed run samples
what the uninterrupted one did.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from zoo.engine.errors import ZooError
from zoo.engine.posttraining.policy_gradient import GRPOOptions, group_advantages
from zoo.engine.posttraining.rewards import RewardFunction, resolve_reward, score
from zoo.engine.registry import Sample

ROW, MASK = "row", "mask"
"""A prompt batch's index into its split's records, and the eval batches' padding mask."""
COMPLETION_MASK, ADVANTAGES, OLD_LOGPS = "completion_mask", "advantages", "old_logps"
LOGGED = "logged/"
"""The prefix of a training batch's columns that the loss passes on as metrics."""
BATCH_FIGURES = (
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "advantages/std",
    "advantages/max_abs",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
)
"""What each batch of completions reports besides each reward function's mean and std: the
total reward's mean and spread, the share of completions in groups of equal rewards, the
advantages' spread, the completions' lengths and the share cut at max_completion_length."""
SHOWN = 4
PYTHON = "python:"
"""How the config names a reward function given from Python (`zoo.finetune(rewards=[fn])`)."""
"""Prompts whose completions an eval writes to TensorBoard's text tab."""


@dataclasses.dataclass(frozen=True)
class Sampled:
    """A batch of prompts made into a training batch, and what an eval shows of it."""

    batch: dict[str, np.ndarray]
    table: str


@dataclasses.dataclass(frozen=True)
class Rollouts:
    """How a batch of prompts becomes a batch of scored completions."""

    options: GRPOOptions
    functions: Sequence[RewardFunction]
    names: Sequence[str]
    sample: Sample
    tokenizer: Any
    records: Mapping[str, Sequence[Mapping[str, Any]]]
    eos: tuple[int, ...]

    def __call__(self, model: Any, prompts: Mapping[str, np.ndarray], split: str, key) -> Sampled:
        options, size = self.options, self.options.num_generations
        ids = [
            np.asarray(row[:length])
            for row, length in zip(prompts["tokens"], prompts["length"], strict=True)
            for _ in range(size)
        ]
        sampling = {"temperature": options.temperature, "top_p": options.top_p}
        sampling["top_k"] = options.top_k
        done = self.sample(model, ids, options.max_completion_length, sampling, key, self.eos)
        records = [self.records[split][int(r)] for r in prompts[ROW] for _ in range(size)]
        texts = [self.tokenizer.decode(list(new[:-1] if ended else new)) for new, ended in done]
        rewards = self._rewards(records, texts, done)
        weights = None if options.reward_weights is None else np.asarray(options.reward_weights)
        advantages, stats = jax.device_get(group_advantages(options, rewards, weights))
        batch = _sequences(ids, done, prompts["tokens"].shape[1], options)
        batch[ADVANTAGES] = np.asarray(advantages, np.float32)
        if MASK in prompts:
            batch[MASK] = np.repeat(np.asarray(prompts[MASK], np.float32), size)
        logged = self._logged(stats, advantages, done)
        batch.update(
            {LOGGED + name: np.full(len(ids), value, np.float32) for name, value in logged.items()}
        )
        return Sampled(batch, _table(records, texts, rewards, self.names, size))

    def _rewards(self, records, texts, done) -> np.ndarray:
        """Every function's reward of every completion [N, F] (NaN: unscored)."""
        columns = {
            name: [record.get(name) for record in records]
            for name in records[0]
            if name not in ("prompt", "where")
        }
        columns["completion_lengths"] = [len(new) for new, _ in done]
        columns["truncated"] = [not ended for _, ended in done]
        rows = [str(record.get("where", "?")) for record in records]
        prompts = [record.get("prompt") for record in records]
        return score(self.functions, prompts, texts, columns, rows, self.options.on_error)

    def _logged(self, stats, advantages, done) -> dict[str, float]:
        """What the run reports of one batch of completions (`logged_names`, in order)."""
        lengths = np.asarray([len(new) for new, _ in done], np.float32)
        values = [
            stats["reward"],
            stats["reward_std"],
            stats["frac_reward_zero_std"],
            np.std(advantages),
            np.max(np.abs(advantages)),
            lengths.mean(),
            lengths.min(),
            lengths.max(),
            np.mean([not ended for _, ended in done]),
        ]
        for index in range(len(self.names)):
            values += [stats["rewards/mean"][index], stats["rewards/std"][index]]
        names = self.logged_names()
        return {name: float(np.nan_to_num(v)) for name, v in zip(names, values, strict=True)}

    def logged_names(self) -> list[str]:
        """The figures each batch of completions reports (`LOGGED` columns)."""
        per_function = [f"rewards/{n}/{s}" for n in self.names for s in ("mean", "std")]
        return [*BATCH_FIGURES, *per_function]

    def placeholder(self, prompts: int, width: int, masked: bool) -> dict[str, np.ndarray]:
        """Zeros in the shapes and columns of the batch `prompts` prompts of `width` tokens
        make (`masked`: an eval batch's): what a step is traced with before anything is
        sampled."""
        n = prompts * self.options.num_generations
        batch = {
            "tokens": np.zeros((n, width), np.int32),
            "length": np.zeros(n, np.int32),
            COMPLETION_MASK: np.zeros((n, width - 1), np.uint8),
            ADVANTAGES: np.zeros(n, np.float32),
        }
        if masked:
            batch[MASK] = np.zeros(n, np.float32)
        batch.update({LOGGED + name: np.zeros(n, np.float32) for name in self.logged_names()})
        return batch


def _sequences(ids, done, prompt_width: int, options: GRPOOptions) -> dict[str, np.ndarray]:
    """Prompt and completion end to end [N, T + 1], the real targets of each, and the mask of
    the targets that are the completion's [N, T]; a truncated completion's mask is empty with
    `mask_truncated_completions`. T + 1 holds the longest prompt and the most tokens a
    completion has, rounded up to a power of two (so that a few widths compile), at most the
    prompts' padded width and those tokens."""
    longest = max(len(prompt) for prompt in ids) + options.max_completion_length
    width = min(prompt_width + options.max_completion_length, 1 << (longest - 1).bit_length())
    tokens = np.zeros((len(ids), width), np.int32)
    mask = np.zeros((len(ids), width - 1), np.uint8)
    length = np.zeros(len(ids), np.int32)
    for n, (prompt, (new, ended)) in enumerate(zip(ids, done, strict=True)):
        sequence = np.concatenate([prompt, np.asarray(new, prompt.dtype)]).astype(np.int32)
        tokens[n, : len(sequence)] = sequence
        length[n] = len(sequence) - 1
        if ended or not options.mask_truncated_completions:
            mask[n, len(prompt) - 1 : len(sequence) - 1] = 1
    return {"tokens": tokens, "length": length, COMPLETION_MASK: mask}


def _table(records, texts, rewards, names, size: int) -> str:
    """The first prompts' completions with their rewards, as a Markdown table."""
    header = "| prompt | completion | " + " | ".join(names) + " |"
    lines = [header, "|" + "---|" * (2 + len(names))]
    for n in range(min(len(texts), SHOWN * size)):
        prompt = _cell(records[n].get("prompt"))
        values = " | ".join("-" if np.isnan(v) else f"{v:.3g}" for v in rewards[n])
        lines.append(f"| {prompt} | {_cell(texts[n])} | {values} |")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    """A value as one table cell: one line, its pipes escaped, at most 200 characters."""
    if not isinstance(value, str):
        value = value[-1]["content"] if isinstance(value, list) and value else str(value)
    text = " ".join(str(value).split()).replace("|", "\\|")
    return text if len(text) <= 200 else text[:199] + "…"


def python_name(function: RewardFunction) -> str:
    """How the config records a reward function given from Python: code, not a setting."""
    name = getattr(function, "__qualname__", None) or type(function).__qualname__
    return f"{PYTHON}{getattr(function, '__module__', '?')}.{name}"


def reward_functions(options: GRPOOptions, given: Sequence[RewardFunction]) -> list:
    """The functions `finetune.grpo.rewards` names: built-ins, `module:function`, and those
    given from Python (recorded by `python_name`)."""
    by_name = {python_name(function): function for function in given}
    if not options.rewards:
        raise ZooError(
            "finetune.method=grpo needs reward functions: finetune.grpo.rewards=[NAME, ...] "
            "with built-ins (exact_match, numeric_match, format, length_penalty) or "
            "module:function names, or zoo.finetune(..., rewards=[function, ...])."
        )
    functions = []
    for name in options.rewards:
        if name.startswith(PYTHON) and name not in by_name:
            raise ZooError(
                f"finetune.grpo.rewards names {name}, a function the run was given from Python: "
                "give it again (zoo.finetune(..., rewards=[...])), or name it as "
                "module:function so that the command line can import it."
            )
        functions.append(
            by_name[name]
            if name.startswith(PYTHON)
            else resolve_reward(
                name,
                max_completion_length=options.max_completion_length,
                length_cache=options.length_cache,
            )
        )
    return functions

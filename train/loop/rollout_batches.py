"""`finetune.method=grpo` in the loop: the batch each step trains on is sampled by the policy
the step before left (`zoo.engine.posttraining.Rollouts`), from the next batch of prompts.

With `finetune.grpo.num_iterations` = mu > 1, one batch of completions serves mu steps: the
policy's log-probabilities of it when it was sampled are kept (`old_logps`), so the ratio of
each later step is to the sampling policy, and a new batch of prompts is read only every mu
steps (the data position counts batches of completions). Checkpoints fall between batches of
completions (`trainer.checkpoint_every` is a multiple of mu), so a resumed run samples the next
one, with the key of its step, as the uninterrupted run did.

Evaluation samples completions of every held-out prompt in the same way (a key per eval step
and batch) and reports the loss's metrics over them: the held-out rewards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from zoo.engine.posttraining import OLD_LOGPS, Rollouts, Sampled, sampled_logps
from zoo.engine.steps import precision
from zoo.engine.steps.rngs import rollout_key

Prepare = Callable[[Mapping[str, Any]], Mapping[str, Any]]


class RolloutBatches:
    """Training and eval batches of sampled completions for one run."""

    def __init__(
        self,
        rollouts: Rollouts,
        graphdef: nnx.GraphDef,
        computes: Any,
        shard: Callable[[Mapping[str, Any]], dict[str, jax.Array]],
        seed: int,
    ):
        self.rollouts, self.graphdef, self.computes = rollouts, graphdef, computes
        self.shard, self.seed = shard, seed
        self.iterations = rollouts.options.num_iterations
        self.table = ""  # the last eval's completions, as a Markdown table
        self._current: dict[str, jax.Array] | None = None
        graph = graphdef

        @jax.jit
        def logps(state, batch):
            model, _ = nnx.merge(graph, state)
            model.eval()
            return sampled_logps(precision.computing(model, computes), batch)

        self._logps = logps

    def training(
        self, state: Any, iterator: Iterator[Any], step: int, prepare: Prepare = dict
    ) -> dict[str, jax.Array]:
        """Step `step`'s batch: completions sampled now from the next prompts (then given to
        `prepare`, e.g. for the reference's column), or, within a batch's `num_iterations`
        steps, the batch sampled at the first of them."""
        if self._current is None or (step - 1) % self.iterations == 0:
            prompts = jax.device_get(next(iterator))
            sampled = self._sampled(state, prompts, "train", rollout_key(self.seed, step))
            batch = self.shard(sampled.batch)
            if self.iterations > 1:
                batch[OLD_LOGPS] = self._logps(state, batch)
            self._current = prepare(batch)
        return self._current

    def evaluation(self, state: Any, eval_data: Iterable[Mapping], step: int) -> Iterator[dict]:
        """Every eval batch of prompts with its completions sampled (host arrays, the `mask`
        of each prompt repeated over its completions); the first batch's table kept."""
        for index, prompts in enumerate(eval_data):
            sampled = self._sampled(state, prompts, "eval", rollout_key(self.seed, step, index + 1))
            if index == 0:
                self.table = sampled.table
            yield sampled.batch

    def placeholder(self, prompts: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """A batch of the shapes and columns a batch of completions of `prompts` has (zeros):
        what the step's metrics and memory are read from before anything is sampled."""
        size, options = len(prompts["tokens"]), self.rollouts.options
        width = prompts["tokens"].shape[1] + options.max_completion_length
        batch = self.rollouts.placeholder(size, width, "mask" in prompts)
        if self.iterations > 1:
            batch[OLD_LOGPS] = np.zeros(batch["tokens"][:, 1:].shape, np.float32)
        return batch

    def _sampled(self, state: Any, prompts: Mapping[str, Any], split: str, key) -> Sampled:
        model, _ = nnx.merge(self.graphdef, state)  # shares the arrays; read only
        model.eval()
        return self.rollouts(precision.computing(model, self.computes), prompts, split, key)

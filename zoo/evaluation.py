"""`zoo.evaluate`: a trained model's eval metrics on a data set, its own or the caller's, each
example counted once, the data checked before the model runs (`zoo.inputs`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from zoo.engine import pipeline, registry, sharding
from zoo.engine.errors import ZooError
from zoo.engine.loop import evaluate_batches
from zoo.engine.posttraining import GRPO, method_of, training_objective
from zoo.engine.steps import eval_key, make_eval_step
from zoo.inputs import Reads, check_columns, check_loss_traced
from zoo.trained import Trained, resolved_hparams


def evaluate(
    trained: Trained,
    data: str | registry.Splits | Mapping[str, np.ndarray] | pipeline.RandomAccess,
    batch_size: int | None = None,
) -> dict[str, float]:
    """The model's eval metrics (its loss and metrics, each example counted once) on a
    registered data set's eval split, the eval split of `Splits` (with its `transform`), or
    columns / a random-access source as the model takes them. Data the model cannot read (a
    column missing or misnamed, strings, examples of a shape it cannot take) is refused by
    name before the model runs. A reward fine-tune (`finetune.method=grpo`) is evaluated on
    completions it samples, which its run does at each eval (`val/` metrics), not here."""
    config = trained.config
    if method_of(config.finetune) == GRPO:
        raise ZooError(
            f"The run in {trained.workdir} is a reward fine-tune (finetune.method=grpo): its "
            "eval samples completions of held-out prompts and scores them with the run's reward "
            "functions, which zoo.evaluate does not; its held-out rewards at each eval are "
            "in its TensorBoard events (val/reward, val/rewards/...) and, for the last, in "
            "RunResult.eval_metrics."
        )
    transform = None
    if isinstance(data, str):
        data = registry.get_data(data).splits({})
    if isinstance(data, registry.Splits):
        data, transform = data.eval, data.transform
    entry = registry.get_model(config.model.name)
    shards = sharding.batch_divisor(trained.mesh, trained.rules)
    size = batch_size or -(-int(config.trainer.batch_size) // shards) * shards
    check_columns(config, resolved_hparams(config), "eval", data, transform)
    batches = pipeline.eval_batches(data, size, transform=transform)
    graphdef, state = nnx.split((trained.model, None))
    eval_step = make_eval_step(graphdef, training_objective(config.finetune, entry.loss))
    key = eval_key(int(config.seed))

    def step(state: Any, batch: Mapping[str, jax.Array]) -> Any:
        return eval_step(state, {}, batch, key)

    with trained.activate():
        first = sharding.shard_batch(batches[0], trained.mesh, trained.rules)
        check_loss_traced(step, state, first, "eval", Reads.of(config))
    return evaluate_batches(eval_step, state, batches, trained.mesh, trained.rules, key)

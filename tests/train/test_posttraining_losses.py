"""The losses of preference and reward fine-tuning equal TRL 1.16's: for the fixed inputs of
tests/fixtures/posttraining/losses.json (made by make_losses.py with TRL's own trainers), zoo's
losses, metrics and gradients with respect to the policy's log-probabilities agree within 1e-5
in float32, for every method and aggregation; and bad options are refused by name."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ROOT
from zoo.engine.errors import ZooError
from zoo.engine.posttraining import (
    GRPOOptions,
    PreferenceOptions,
    group_advantages,
    grpo_loss,
    preference_loss,
    sequence_logps,
)
from zoo.engine.registry import WEIGHT

FIXTURE = json.loads((ROOT / "tests/fixtures/posttraining/losses.json").read_text())
PREFERENCE, POLICY = FIXTURE["preference"], FIXTURE["policy"]
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
CLIPS = ("low", "high", "region")


def case_id(case: dict) -> str:
    return ",".join(f"{key}={value}" for key, value in case["options"].items())


def close(actual, expected) -> None:
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected, np.float32), **TOLERANCE)


def preference(options: PreferenceOptions, token_logps: jax.Array) -> tuple[jax.Array, dict]:
    """The fixture's pairs (the chosen sequences' rows, then the rejected's) through zoo's loss."""
    x = {name: jnp.asarray(value) for name, value in PREFERENCE["inputs"].items()}
    chosen, rejected = slice(0, token_logps.shape[0] // 2), slice(token_logps.shape[0] // 2, None)
    # Next-token log-probs: position t scores token t + 1.
    reply, real = x["completion_mask"][:, 1:], x["attention_mask"][:, 1:]
    ref = sequence_logps(x["ref_token_logps"], reply).total
    return preference_loss(
        options,
        sequence_logps(token_logps[chosen], reply[chosen]),
        sequence_logps(token_logps[rejected], reply[rejected]),
        reference=(ref[chosen], ref[rejected]) if options.uses_reference else None,
        chosen_sequence=sequence_logps(token_logps[chosen], real[chosen]),
    )


@pytest.mark.parametrize("case", PREFERENCE["cases"], ids=case_id)
def test_preference_losses_match_trl(case):
    options = PreferenceOptions(**case["options"])
    token_logps = jnp.asarray(PREFERENCE["inputs"]["token_logps"], jnp.float32)
    loss, metrics = preference(options, token_logps)
    assert loss.shape == (token_logps.shape[0] // 2,) and loss.dtype == jnp.float32
    close(jnp.mean(loss), case["loss"])
    assert set(metrics) <= set(case["metrics"]), set(metrics) - set(case["metrics"])
    assert {"rewards/chosen", "rewards/margins", "rewards/accuracies", "logps/chosen"} <= set(
        metrics
    )
    for name, values in metrics.items():
        assert values.shape == loss.shape, name
        close(jnp.mean(values), case["metrics"][name])
    grad = jax.grad(lambda logps: jnp.mean(preference(options, logps)[0]))(token_logps)
    close(grad, case["grad"])


def rewards() -> np.ndarray:
    """The fixture's rewards, one column per reward function, NaN where it gave none."""
    columns = [
        [np.nan if r is None else r for r in column] for column in POLICY["inputs"]["rewards"]
    ]
    return np.asarray(columns, np.float32).T


@pytest.mark.parametrize("case", POLICY["advantages"], ids=lambda case: case["scale_rewards"])
def test_group_advantages_match_trl(case):
    options = GRPOOptions(
        num_generations=POLICY["inputs"]["num_generations"], scale_rewards=case["scale_rewards"]
    )
    weights = jnp.asarray(POLICY["inputs"]["reward_weights"], jnp.float32)
    advantages, stats = group_advantages(options, jnp.asarray(rewards()), weights)
    close(advantages, case["advantages"])
    for name in ("reward", "reward_std", "frac_reward_zero_std"):
        close(stats[name], case["metrics"][name])
    for i, name in enumerate(("correct", "format")):
        close(stats["rewards/mean"][i], case["metrics"][f"rewards/{name}/mean"])
        close(stats["rewards/std"][i], case["metrics"][f"rewards/{name}/std"])


def policy(options: GRPOOptions, token_logps: jax.Array, on_policy: bool) -> tuple[jax.Array, dict]:
    """The fixture's completions through zoo's loss, with TRL's group advantages."""
    x = {
        name: jnp.asarray(value, jnp.float32)
        for name, value in POLICY["inputs"].items()
        if name.endswith("logps") or name == "completion_mask"
    }
    advantages = next(a for a in POLICY["advantages"] if a["scale_rewards"] == "group")
    return grpo_loss(
        options,
        token_logps,
        x["completion_mask"],
        jnp.asarray(advantages["advantages"], jnp.float32),
        old_token_logps=None if on_policy else x["old_token_logps"],
        ref_token_logps=x["ref_token_logps"],
    )


def batch_mean(values: jax.Array, metrics: dict) -> jax.Array:
    """The mean over the batch that the trainer takes: weighted when the loss gives weights."""
    weight = metrics.get(WEIGHT, jnp.ones_like(values))
    return jnp.sum(values * weight) / jnp.sum(weight)


@pytest.mark.parametrize("case", POLICY["cases"], ids=case_id)
def test_grpo_losses_match_trl(case):
    given = dict(case["options"])
    on_policy = given.pop("on_policy", False)
    options = GRPOOptions(num_generations=POLICY["inputs"]["num_generations"], **given)
    token_logps = jnp.asarray(POLICY["inputs"]["token_logps"], jnp.float32)
    loss, metrics = policy(options, token_logps, on_policy)
    assert loss.shape == (token_logps.shape[0],)
    assert (WEIGHT in metrics) == (options.loss_type in ("dapo", "bnpo"))
    close(batch_mean(loss, metrics), case["loss"])
    grad = jax.grad(lambda logps: batch_mean(*policy(options, logps, on_policy)))(token_logps)
    close(grad, case["grad"])
    # TRL logs each as a mean over all the batch's completion tokens.
    tokens = jnp.sum(jnp.asarray(POLICY["inputs"]["completion_mask"], jnp.float32), -1)
    expected = case["metrics"]
    assert ("kl" in metrics) == ("kl" in expected)
    logged = {"kl": "kl", **{f"clip_ratio/{c}": f"clip_ratio/{c}_mean" for c in CLIPS}}
    for name, trl_name in logged.items():
        if name in metrics:
            close(jnp.sum(metrics[name] * tokens) / jnp.sum(tokens), expected[trl_name])
    close(jnp.min(metrics["clip_ratio/low"]), expected["clip_ratio/low_min"])
    close(jnp.max(metrics["clip_ratio/high"]), expected["clip_ratio/high_max"])


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: PreferenceOptions(loss_type="dpo"), ["loss_type='dpo'", "sigmoid", "orpo"]),
        (lambda: PreferenceOptions(beta=0), ["beta=0", "positive"]),
        (lambda: PreferenceOptions(beta=float("nan")), ["beta=nan"]),
        (lambda: PreferenceOptions(label_smoothing=0.5), ["label_smoothing=0.5", "[0, 0.5)"]),
        (
            lambda: PreferenceOptions(loss_type="ipo", label_smoothing=0.1),
            ["loss_type=ipo", "no effect"],
        ),
        (lambda: PreferenceOptions(loss_type="simpo", gamma=-1.0), ["gamma=-1.0"]),
        (lambda: PreferenceOptions(loss_type="sigmoid", gamma=0.3), ["gamma=0.3", "simpo"]),
        (
            lambda: PreferenceOptions(loss_type="orpo", reference="copy"),
            ["reference=copy", "no effect", "loss_type=orpo"],
        ),
        (lambda: GRPOOptions(loss_type="ppo"), ["loss_type='ppo'", "dr_grpo"]),
        (lambda: GRPOOptions(scale_rewards=True), ["scale_rewards=True", "group, batch, none"]),
        (lambda: GRPOOptions(beta=-0.1), ["beta=-0.1", ">= 0"]),
        (lambda: GRPOOptions(beta=0.1, reference="frozen"), ["reference='frozen'", "copy"]),
        (lambda: GRPOOptions(beta=0.1, reference="precomputed"), ["sampled as the run goes"]),
        (lambda: GRPOOptions(reference="copy"), ["reference=copy", "beta=0"]),
        (lambda: GRPOOptions(epsilon=1.0), ["epsilon=1.0", "[0, 1)"]),
        (lambda: GRPOOptions(epsilon_high=-0.2), ["epsilon_high=-0.2"]),
        (lambda: GRPOOptions(use_bias_correction_kl=1), ["use_bias_correction_kl=1"]),
        (lambda: GRPOOptions(max_completion_length=0), ["max_completion_length=0"]),
        (lambda: GRPOOptions(num_generations=1), ["num_generations=1", ">= 2"]),
    ],
)
def test_bad_options_are_refused_by_name(make, words):
    with pytest.raises(ZooError) as refused:
        make()
    for word in words:
        assert word in str(refused.value)


def test_missing_inputs_are_named():
    one = jnp.zeros((2,))
    side = sequence_logps(jnp.zeros((2, 3)), jnp.ones((2, 3)))
    with pytest.raises(ZooError, match="reference's log-probabilities"):
        preference_loss(PreferenceOptions(), side, side)
    with pytest.raises(ZooError, match="chosen_sequence"):
        preference_loss(PreferenceOptions(loss_type="orpo"), side, side)
    with pytest.raises(ZooError, match="ref_token_logps"):
        grpo_loss(GRPOOptions(beta=0.1), jnp.zeros((2, 3)), jnp.ones((2, 3)), one)
    with pytest.raises(ZooError, match="groups of num_generations=4"):
        group_advantages(GRPOOptions(num_generations=4), jnp.zeros((6, 1)))


def test_what_padding_holds_reaches_neither_loss_nor_gradient():
    # A masked log-softmax leaves -inf where there is no token: the sums and ratios skip them.
    options = GRPOOptions(num_generations=4, beta=0.04)
    mask = jnp.asarray(POLICY["inputs"]["completion_mask"]) > 0
    advantages = jnp.linspace(-1.0, 1.0, mask.shape[0])

    def grpo(logps):
        loss, metrics = grpo_loss(options, logps, mask, advantages, ref_token_logps=logps + 0.1)
        return batch_mean(loss, metrics)

    def orpo(logps):
        return jnp.mean(preference(PreferenceOptions(loss_type="orpo"), logps)[0])

    real_pairs = jnp.asarray(PREFERENCE["inputs"]["attention_mask"])[:, 1:] > 0
    for loss, logps, real in (
        (grpo, POLICY["inputs"]["token_logps"], mask),
        (orpo, PREFERENCE["inputs"]["token_logps"], real_pairs),
    ):
        logps = jnp.asarray(logps, jnp.float32)
        padded = jnp.where(real, logps, -jnp.inf)
        for dirty, clean in zip(jax.value_and_grad(loss)(padded), jax.value_and_grad(loss)(logps)):
            close(dirty, clean)

"""Preference and reward fine-tuning on a real checkpoint's own log-probabilities equal TRL
1.16's: for the tiny Qwen 2.5 chat checkpoint and the fixed batches of
tests/fixtures/posttraining/model_losses.json (made by make_model_losses.py with TRL's own
trainers on the same checkpoint read by transformers), zoo's training objectives give TRL's
loss within 1e-5 and the gradients of the named params within 1e-5 of their largest entry, in
float32, on one device and on the 2x2x2 mesh: DPO (`sigmoid`, `ipo`, `hinge`), SimPO and ORPO
over pairs (one to a row, and packed several to a row as `data.packing=true` packs them), GRPO
under each aggregation over completions with fixed advantages and old log-probabilities.

The reference model is the checkpoint itself, the policy the checkpoint with its final norm's
scale set to the fixture's values. The reference's log-probabilities reach the loss as
`reference=precomputed` gives them: a `reference_logps` column that zoo computes with
`pair_logps` from the checkpoint before the policy's norm is set (checked against TRL's)."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conformance.checks import MESH, ONE_DEVICE
from flax import nnx
from helpers import ROOT
from zoo.data.packing import pack, packed_rows
from zoo.engine.posttraining import GRPOOptions, PreferenceOptions
from zoo.engine.posttraining.objectives import (
    REFERENCE_LOGPS,
    pair_logps,
    policy_objective,
    preference_objective,
)
from zoo.engine.posttraining.rollouts import OLD_LOGPS
from zoo.engine.registry import PAIR_SLOTS, WEIGHT
from zoo.engine.sharding import mesh as sharding
from zoo.engine.weights import pretrained as weights

from zoo.loading import checkpoint_hparams, plan_pretrained

FIXTURE = json.loads((ROOT / "tests/fixtures/posttraining/model_losses.json").read_text())
CHECKPOINT = ROOT / "tests/fixtures/pretrained" / FIXTURE["checkpoint"]
PREFERENCE, POLICY = FIXTURE["preference"], FIXTURE["policy"]
WITH_REFERENCE = ("sigmoid", "ipo", "hinge")
ONE_TO_A_ROW, PACKED = "one-to-a-row", "packed"
PACKED_WIDTH = 20
LOSS_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
GRAD_TOLERANCE = 1e-5
"""Each gradient's largest difference from TRL's, relative to its largest entry."""


def case_id(case: dict) -> str:
    return ",".join(f"{key}={value}" for key, value in case["options"].items())


def zoo_path(path: str) -> tuple:
    return tuple(int(key) if key.isdigit() else key for key in path.split("."))


def param(model: nnx.Module, path: str) -> nnx.Param:
    """The param of `model` at a dotted path (`layers.1.mlp_norm.scale`)."""
    for key in zoo_path(path):
        model = model[key] if isinstance(key, int) else getattr(model, key)
    return model


@pytest.fixture(scope="module", params=[ONE_DEVICE, MESH], ids=["one-device", "mesh-2x2x2"])
def placed(request):
    """The checkpoint loaded as `zoo.load` loads it onto the mesh, the fixture's batches placed
    on it split along the batch axes, and the reference's log-probabilities of the pairs; the
    model then made the policy."""
    one_device = request.param == ONE_DEVICE
    pretrained = weights.open_pretrained(CHECKPOINT)
    planned = plan_pretrained(
        pretrained,
        checkpoint_hparams(pretrained),
        request.param,
        jax.devices()[:1] if one_device else None,
    )
    model = planned.fill()
    pairs = {
        name: np.asarray(PREFERENCE["inputs"][name], dtype)
        for name, dtype in (("tokens", np.int32), ("length", np.int32), ("loss_mask", np.uint8))
    }
    completions = {
        name: np.asarray(POLICY["inputs"][name], dtype)
        for name, dtype in (
            ("tokens", np.int32),
            ("length", np.int32),
            ("completion_mask", np.uint8),
            ("advantages", np.float32),
            ("old_logps", np.float32),
        )
    }
    packed = packed_pairs(pairs)
    with sharding.activate(planned.mesh, planned.rules), jax.default_matmul_precision("highest"):
        pairs = sharding.shard_batch(pairs, planned.mesh, planned.rules)
        pairs[REFERENCE_LOGPS] = nnx.jit(pair_logps)(model, pairs)
        packed = sharding.shard_batch(packed, planned.mesh, planned.rules)
        packed[REFERENCE_LOGPS] = nnx.jit(pair_logps)(model, packed)
        completions = sharding.shard_batch(completions, planned.mesh, planned.rules)
        for name, values in FIXTURE["policy_params"].items():
            variable = param(model, FIXTURE["params"][name])
            variable.set_value(jax.device_put(np.float32(values), variable.get_value().sharding))
    return planned, model, {ONE_TO_A_ROW: pairs, PACKED: packed}, completions


def packed_layout() -> list[list[int]]:
    """The fixture's pairs as `data.packing=true` places them (first-fit into rows of
    `PACKED_WIDTH` targets: two rows of two pairs), with a row of no pair after each."""
    sizes = np.asarray(PREFERENCE["inputs"]["length"]).max(1) + 1
    rows = [[int(i) for i in row] for row in packed_rows(sizes, PACKED_WIDTH + 1)]
    assert [len(row) for row in rows] == [2, 2]
    return [rows[0], [], rows[1], []]


def packed_pairs(pairs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The fixture's pairs packed as `packed_layout` places them."""
    layout, tokens, marks = packed_layout(), pairs["tokens"], pairs["loss_mask"]
    sides = []
    for side in (0, 1):
        pieces = [
            [
                (tokens[i, side, : n + 1], np.concatenate([[0], marks[i, side, :n]]))
                for i, n in ((i, pairs["length"][i, side]) for i in row)
            ]
            for row in layout
        ]
        sides.append(pack(pieces, PACKED_WIDTH))
    slots = np.array([[1] * len(row) + [0] * (2 - len(row)) for row in layout], np.uint8)
    return {**{c: np.stack([s[c] for s in sides], 1) for c in sides[0]}, PAIR_SLOTS: slots}


def objective_of(section: str, options: dict):
    """Zoo's training objective of a fixture's case, and whether it reads old
    log-probabilities."""
    given = dict(options)
    if section == "preference":
        if given["loss_type"] in WITH_REFERENCE:
            given["reference"] = "precomputed"
        return preference_objective(PreferenceOptions(**given)), False
    on_policy = given.pop("on_policy", False)
    return policy_objective(GRPOOptions(**given)), not on_policy


def mean_loss(objective, model: nnx.Module, batch) -> jax.Array:
    """The objective's loss over the batch as the trainer averages it: weighted where the loss
    gives weights."""
    losses, metrics = objective(model, batch, nnx.Rngs(0))
    weight = metrics.get(WEIGHT, jnp.ones_like(losses))
    return jnp.sum(losses * weight) / jnp.sum(weight)


def loss_and_grads(
    placed, section: str, options: dict, layout: str = ONE_TO_A_ROW
) -> tuple[float, dict[str, np.ndarray]]:
    """Zoo's loss of a case over its batch (pairs laid out as `layout` says) and the named
    params' gradients."""
    planned, model, pairs, completions = placed
    objective, reads_old = objective_of(section, options)
    batch = pairs[layout] if section == "preference" else dict(completions)
    if section == "policy" and not reads_old:
        del batch[OLD_LOGPS]
    with sharding.activate(planned.mesh, planned.rules), jax.default_matmul_precision("highest"):
        loss, grads = nnx.jit(nnx.value_and_grad(functools.partial(mean_loss, objective)))(
            model, batch
        )
    flat = dict(nnx.to_flat_state(grads))
    return float(loss), {
        name: np.asarray(flat[zoo_path(path)].get_value())
        for name, path in FIXTURE["params"].items()
    }


def assert_matches(loss: float, grads: dict[str, np.ndarray], case: dict) -> None:
    np.testing.assert_allclose(loss, case["loss"], **LOSS_TOLERANCE)
    for name, expected in case["grads"].items():
        expected = np.asarray(expected, np.float32)
        actual = grads[name].reshape(expected.shape)
        scale = np.abs(expected).max()
        np.testing.assert_allclose(
            actual, expected, rtol=0, atol=GRAD_TOLERANCE * scale, err_msg=name
        )


def test_the_reference_log_probabilities_equal_trl(placed):
    _, _, pairs, _ = placed
    expected = np.asarray(PREFERENCE["inputs"]["reference_logps"], np.float32)
    got = pairs[ONE_TO_A_ROW][REFERENCE_LOGPS]
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, atol=0)
    packed = np.asarray(pairs[PACKED][REFERENCE_LOGPS])  # [row, side, slot]
    for row, held in enumerate(packed_layout()):
        for slot, pair in enumerate(held):
            np.testing.assert_allclose(packed[row, :, slot], expected[pair], rtol=1e-6, atol=0)


@pytest.mark.parametrize("layout", [ONE_TO_A_ROW, PACKED])
@pytest.mark.parametrize("case", PREFERENCE["cases"], ids=case_id)
def test_preference_losses_and_gradients_match_trl(placed, case, layout):
    assert_matches(*loss_and_grads(placed, "preference", case["options"], layout), case)


@pytest.mark.parametrize("case", POLICY["cases"], ids=case_id)
def test_grpo_losses_and_gradients_match_trl(placed, case):
    assert_matches(*loss_and_grads(placed, "policy", case["options"]), case)

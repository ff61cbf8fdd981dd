"""Preference and reward fine-tuning on a real checkpoint's own log-probabilities equal TRL
1.16's: for the tiny Qwen 2.5 chat checkpoint and the fixed batches of
tests/fixtures/posttraining/model_losses.json (made by make_model_losses.py with TRL's own
trainers on the same checkpoint read by transformers), zoo's training objectives give TRL's
loss within 1e-5 and the gradients of the named params within 1e-5 of their largest entry, in
float32, on one device and on the 2x2x2 mesh: DPO (`sigmoid`, `ipo`, `hinge`), SimPO and ORPO
over pairs (one to a row, and packed several to a row as `data.packing=true` packs them), GRPO
under each aggregation over completions with fixed advantages and old log-probabilities. And
for the tiny Qwen3-MoE checkpoint (model_losses_experts.json), DPO and GRPO with the router's
load-balancing loss added, as TRL's trainers add it, its gradient reaching the routers.

The reference model is the checkpoint itself, the policy the checkpoint with its final norm's
scale set to the fixture's values. The reference's log-probabilities reach the loss as
`reference=precomputed` gives them: a `reference_logps` column that zoo computes with
`pair_logps` from the checkpoint before the policy's norm is set (checked against TRL's)."""

from __future__ import annotations

import functools
import json
from typing import Any, NamedTuple

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

FIXTURES = {
    variant: json.loads((ROOT / f"tests/fixtures/posttraining/{name}.json").read_text())
    for variant, name in (("dense", "model_losses"), ("experts", "model_losses_experts"))
}
DEVICES = {"one-device": ONE_DEVICE, "mesh-2x2x2": MESH}
WITH_REFERENCE = ("sigmoid", "ipo", "hinge")
ONE_TO_A_ROW, PACKED = "one-to-a-row", "packed"
PACKED_WIDTH = {"dense": 20, "experts": 21}
"""Targets a packed row holds: the dense fixture's first row ends full; the mixture's rows end
before their last token, which zoo's rows hold as a target only, outside the model's inputs,
where TRL's forward routes it (docs/language-models.md says so)."""
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


@pytest.fixture(scope="module")
def placed(request):
    """For a (fixture, device) pair: the fixture's checkpoint loaded as `zoo.load` loads it
    onto the device or the mesh (with the fixture's router loss weight), the fixture's batches
    placed on it split along the batch axes, and the reference's log-probabilities of the
    pairs; the model then made the policy."""
    variant, device = request.param
    fixture, one_device = FIXTURES[variant], DEVICES[device] == ONE_DEVICE
    preference, policy = fixture["preference"], fixture["policy"]
    pretrained = weights.open_pretrained(ROOT / "tests/fixtures/pretrained" / fixture["checkpoint"])
    router = {"router_aux_loss_coef": fixture.get("router_aux_loss_coef", 0.0)}
    planned = plan_pretrained(
        pretrained,
        checkpoint_hparams(pretrained, router if router["router_aux_loss_coef"] else None),
        DEVICES[device],
        jax.devices()[:1] if one_device else None,
    )
    model = planned.fill()
    pairs = {
        name: np.asarray(preference["inputs"][name], dtype)
        for name, dtype in (("tokens", np.int32), ("length", np.int32), ("loss_mask", np.uint8))
    }
    completions = {
        name: np.asarray(policy["inputs"][name], dtype)
        for name, dtype in (
            ("tokens", np.int32),
            ("length", np.int32),
            ("completion_mask", np.uint8),
            ("advantages", np.float32),
            ("old_logps", np.float32),
        )
    }
    layout = packed_layout(pairs["length"], PACKED_WIDTH[variant])
    packed = packed_pairs(pairs, layout, PACKED_WIDTH[variant])
    with sharding.activate(planned.mesh, planned.rules), jax.default_matmul_precision("highest"):
        pairs = sharding.shard_batch(pairs, planned.mesh, planned.rules)
        pairs[REFERENCE_LOGPS] = nnx.jit(pair_logps)(model, pairs)
        packed = sharding.shard_batch(packed, planned.mesh, planned.rules)
        packed[REFERENCE_LOGPS] = nnx.jit(pair_logps)(model, packed)
        completions = sharding.shard_batch(completions, planned.mesh, planned.rules)
        for name, values in fixture["policy_params"].items():
            variable = param(model, fixture["params"][name])
            variable.set_value(jax.device_put(np.float32(values), variable.get_value().sharding))
    placed = Placed(planned, model, {ONE_TO_A_ROW: pairs, PACKED: packed}, layout, completions)
    return fixture, placed


class Placed(NamedTuple):
    planned: Any
    model: nnx.Module
    pairs: dict[str, dict[str, jax.Array]]
    layout: list[list[int]]
    """Which pairs each packed row holds."""
    completions: dict[str, jax.Array]


def with_placed(section: str, *layouts: str) -> pytest.MarkDecorator:
    """Parametrize a test over every fixture's cases of `section` (and `layouts`), on one
    device and on the mesh, each with its fixture's `placed`."""
    params = [
        pytest.param(
            (variant, device),
            index,
            *layout,
            id="-".join([variant, device, case_id(case), *layout]),
        )
        for variant, fixture in FIXTURES.items()
        for device in DEVICES
        for index, case in enumerate(fixture[section]["cases"])
        for layout in ([(name,) for name in layouts] or [()])
    ]
    names = ("placed", "index", *(("layout",) if layouts else ()))
    return pytest.mark.parametrize(names, params, indirect=["placed"])


def packed_layout(length: np.ndarray, width: int) -> list[list[int]]:
    """A fixture's pairs (their `length`s) as `data.packing=true` places them (first-fit into
    rows of `width` targets: two rows of two pairs), with a row of no pair after each."""
    sizes = np.asarray(length).max(1) + 1
    rows = [[int(i) for i in row] for row in packed_rows(sizes, width + 1)]
    assert [len(row) for row in rows] == [2, 2]
    return [rows[0], [], rows[1], []]


def packed_pairs(
    pairs: dict[str, np.ndarray], layout: list[list[int]], width: int
) -> dict[str, np.ndarray]:
    """The fixture's pairs packed into rows of `width` targets as `layout` places them."""
    tokens, marks = pairs["tokens"], pairs["loss_mask"]
    sides = []
    for side in (0, 1):
        pieces = [
            [
                (tokens[i, side, : n + 1], np.concatenate([[0], marks[i, side, :n]]))
                for i, n in ((i, pairs["length"][i, side]) for i in row)
            ]
            for row in layout
        ]
        sides.append(pack(pieces, width))
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
    fixture: dict, placed: Placed, section: str, options: dict, layout: str = ONE_TO_A_ROW
) -> tuple[float, dict[str, np.ndarray]]:
    """Zoo's loss of a case over its batch (pairs laid out as `layout` says) and the named
    params' gradients."""
    objective, reads_old = objective_of(section, options)
    batch = placed.pairs[layout] if section == "preference" else dict(placed.completions)
    if section == "policy" and not reads_old:
        del batch[OLD_LOGPS]
    mesh, rules = placed.planned.mesh, placed.planned.rules
    with sharding.activate(mesh, rules), jax.default_matmul_precision("highest"):
        loss, grads = nnx.jit(nnx.value_and_grad(functools.partial(mean_loss, objective)))(
            placed.model, batch
        )
    flat = dict(nnx.to_flat_state(grads))
    return float(loss), {
        name: np.asarray(flat[zoo_path(path)].get_value())
        for name, path in fixture["params"].items()
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


@pytest.mark.parametrize(
    "placed", [(variant, device) for variant in FIXTURES for device in DEVICES], indirect=True
)
def test_the_reference_log_probabilities_equal_trl(placed):
    fixture, placed = placed
    expected = np.asarray(fixture["preference"]["inputs"]["reference_logps"], np.float32)
    got = placed.pairs[ONE_TO_A_ROW][REFERENCE_LOGPS]
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, atol=0)
    packed = np.asarray(placed.pairs[PACKED][REFERENCE_LOGPS])  # [row, side, slot]
    for row, held in enumerate(placed.layout):
        for slot, pair in enumerate(held):
            np.testing.assert_allclose(packed[row, :, slot], expected[pair], rtol=1e-6, atol=0)


@with_placed("preference", ONE_TO_A_ROW, PACKED)
def test_preference_losses_and_gradients_match_trl(placed, index, layout):
    fixture, placed = placed
    case = fixture["preference"]["cases"][index]
    assert_matches(*loss_and_grads(fixture, placed, "preference", case["options"], layout), case)


@with_placed("policy")
def test_grpo_losses_and_gradients_match_trl(placed, index):
    fixture, placed = placed
    case = fixture["policy"]["cases"][index]
    assert_matches(*loss_and_grads(fixture, placed, "policy", case["options"]), case)

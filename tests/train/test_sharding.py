"""Meshes, logical-axis rules and the sharding plan, on 8 simulated CPU devices: every strategy
(data parallel, FSDP, tensor parallel and their mixes) computes the single-device step."""

from __future__ import annotations

import deep_mlp
import jax
import numpy as np
import optax
import pytest
from conformance.checks import make_mesh
from flax import nnx
from helpers import one_step, overriding, read_events, run_cli
from jax.sharding import PartitionSpec as P
from zoo.engine import registry
from zoo.engine.loop.trainer import Trainer
from zoo.engine.sharding import mesh as sharding
from zoo.engine.sharding.plan import create_sharded

import zoo
from zoo.plugin import partitioned

MESHES = [
    {"data": 8},
    {"fsdp": 8},
    {"tensor": 2, "data": 4},
    {"fsdp": 4, "tensor": 2},
    {"data": 2, "fsdp": 2, "tensor": 2},
]
MODELS = {
    "xor": ["trainer.steps=20", "trainer.batch_size=64", "trainer.steps_per_dispatch=1"],
    deep_mlp.MODEL: [],
}


def config(model: str, workdir, mesh: dict[str, int], *extra: str):
    sizes = {"data": 1, "fsdp": 1, "tensor": 1, **mesh}
    overrides = [f"mesh.{axis}={size}" for axis, size in sizes.items()]
    return zoo.compose(
        overriding(f"model={model}", f"workdir={workdir}", *MODELS[model], *overrides, *extra)
    )


@pytest.fixture(scope="module", params=list(MODELS))
def reference(request, tmp_path_factory):
    """The single-device step and 20-step training run of each model."""
    model = request.param
    trainer = Trainer(config(model, tmp_path_factory.mktemp("ref"), {}), jax.devices()[:1])
    loss, grads = one_step(trainer)
    result = trainer.fit()
    return model, loss, grads, jax.device_get(jax.tree.leaves(result.state[0]))


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_every_mesh_computes_the_single_device_step(reference, mesh, tmp_path):
    model, ref_loss, ref_grads, ref_params = reference
    trainer = Trainer(config(model, tmp_path, mesh))
    assert len(trainer.mesh.devices.flat) == 8
    loss, grads = one_step(trainer)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    params = jax.device_get(jax.tree.leaves(trainer.fit().state[0]))
    for got, want in zip(params, ref_params, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "mesh", MESHES[1:], ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items())
)
def test_actual_shardings_follow_the_plan(mesh, tmp_path):
    trainer = Trainer(config(deep_mlp.MODEL, tmp_path, mesh))
    rows = {row.path: row for row in trainer.plan.rows}
    flat = nnx.to_flat_state(trainer.state)
    assert len(flat) == len(rows)
    for path, variable in flat:
        name, leaf = ".".join(str(part) for part in path[1:]), variable[...]
        assert jax.typeof(leaf).sharding.spec == rows[name].spec, name
        shard_bytes = leaf.addressable_shards[0].data.nbytes
        assert shard_bytes == rows[name].bytes_per_device, name


def test_fsdp_divides_param_and_optimizer_bytes_by_eight(tmp_path):
    trainer = Trainer(config(deep_mlp.MODEL, tmp_path, {"fsdp": 8}))
    sharded = [row for row in trainer.plan.rows if "fsdp" in str(row.spec)]
    assert {row.group for row in sharded} == {"params", "optimizer"}
    per_device = sum(row.bytes_per_device for row in sharded)
    total = sum(row.bytes_total for row in sharded)
    assert per_device == pytest.approx(total / 8, rel=0.05)
    kernel = trainer.state[0]["layers"][0]["kernel"][...]
    assert kernel.addressable_shards[0].data.shape == (2, 64)  # (16, 64) split 8 ways on fsdp


def test_mesh_sizes_fill_and_mismatch():
    assert sharding.resolve_mesh_shape({"data": -1, "fsdp": 2, "tensor": 1}, 8) == (4, 2, 1, 1)
    assert sharding.resolve_mesh_shape({"data": -1, "expert": 4}, 8) == (2, 1, 4, 1)
    with pytest.raises(zoo.ZooError, match=r"needs 4 devices but 8 are available.*mesh.data=8"):
        sharding.resolve_mesh_shape({"data": 2, "fsdp": 2, "tensor": 1}, 8)
    with pytest.raises(zoo.ZooError, match="at most one may be -1"):
        sharding.resolve_mesh_shape({"data": -1, "fsdp": -1, "tensor": 1}, 8)
    with pytest.raises(zoo.ZooError, match="multiply to 3, which does not divide 8"):
        sharding.resolve_mesh_shape({"data": -1, "fsdp": 3, "tensor": 1}, 8)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["model=xor", "model.num_hidden=6", "mesh.tensor=4", "mesh.data=2"],
            (
                r"'hidden.bias' \(shape \(6,\)\) has dimension 0 of size 6 \('mlp'\), which mesh "
                r"axes \['tensor'\] cannot split 4 ways"
            ),
        ),
        (
            [f"model={deep_mlp.MODEL}", "mesh.rules.embed=tensor"],
            (
                r"'layers.0.kernel' \(shape \(16, 64\)\) would use mesh axis 'tensor' twice: on "
                r"dimension 0 and on dimension 1"
            ),
        ),
        (
            [f"model={deep_mlp.MODEL}", "~mesh.rules.mlp"],
            (
                r"'head.kernel' \(shape \(64, 4\)\) on dimension 0 uses the logical axis 'mlp', "
                r"which no sharding rule maps. Known logical axes: batch, conv_in"
            ),
        ),
        (["model=xor", "mesh.rules.mlp=gpu"], r"mesh.rules.mlp=\['gpu'\] is invalid"),
        (["model=xor", "mesh.data=3"], r"needs 3 devices but 8 are available"),
    ],
)
def test_bad_meshes_and_rules_name_the_param_dimension_and_axes(overrides, message, tmp_path):
    with pytest.raises(zoo.ZooError, match=message):
        Trainer(zoo.compose([*overrides, f"workdir={tmp_path}"]))


def test_cli_trains_on_a_three_axis_mesh_and_logs_the_plan(tmp_path):
    result = run_cli(
        "model=xor",
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "mesh.cpu_devices=8",
        "trainer.steps=300",
        f"workdir={tmp_path}",
        env={"JAX_NUM_CPU_DEVICES": None},
    )
    assert result.returncode == 0, result.stderr
    assert "Sharding plan on mesh data=2 fsdp=2 expert=1 tensor=2 (8 devices)" in result.stderr
    assert "hidden.kernel  (None, 'mlp')  P(None, 'tensor')" in result.stderr
    events = read_events(tmp_path)
    plan = events.Tensors("sharding_plan/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "P(None, 'tensor')" in plan
    assert events.Scalars("val/accuracy")[-1].value >= 0.99


def test_unsharded_activation_spec_needs_rules():
    with pytest.raises(zoo.ZooError, match="No sharding rules are active"):
        sharding.logical_spec("batch", None)
    rules = sharding.AxisRules.from_mapping({"batch": ["data", "fsdp"], "mlp": "tensor"})
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    with sharding.activate(mesh, rules):
        assert sharding.logical_spec("batch", "mlp") == P(("data", "fsdp"), "tensor")


class TwoLayers(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = partitioned(nnx.initializers.lecun_normal(), ("embed", "mlp"))
        self.inward = nnx.Param(init(rngs.params(), (16, 32)))
        self.outward = nnx.Param(init(rngs.params(), (16, 32)))


def test_a_prefilled_param_is_taken_without_a_copy_and_the_rest_born_as_ever():
    """`create_sharded`'s `prefill` (a fine-tune's starting weights, read before the model is
    built): the array it sets becomes the model's param, its buffers handed over, not copied,
    and every other array of the model and its optimizer is the one the plain build makes, to
    the bit, from the same random streams."""
    on = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    rules = sharding.AxisRules.from_mapping(sharding.DEFAULT_RULES)

    def create():
        model = TwoLayers(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    given = {}

    def prefill(abstract):
        variable = abstract[0].outward
        spec = sharding.variable_sharding(variable, "outward", on, rules)
        given["array"] = jax.device_put(np.full(variable.shape, 3.0, np.float32), spec)
        variable.set_value(given["array"])

    with sharding.activate(on, rules):
        (plain, plain_optimizer), _ = create_sharded(create, on, rules)
        (model, optimizer), plan = create_sharded(create, on, rules, prefill)
    assert given["array"].is_deleted()  # donated: its buffers are the param's now
    np.testing.assert_array_equal(model.outward[...], 3.0)
    assert jax.typeof(model.outward[...]).sharding.spec == plan.row("outward").spec
    np.testing.assert_array_equal(model.inward[...], plain.inward[...])
    assert not np.array_equal(model.outward[...], plain.outward[...])
    for (path, ours), (_, theirs) in zip(
        nnx.to_flat_state(nnx.state(optimizer)),
        nnx.to_flat_state(nnx.state(plain_optimizer)),
        strict=True,
    ):
        np.testing.assert_array_equal(ours[...], theirs[...], err_msg=str(path))


def test_a_run_that_resumes_is_built_abstract_and_restored_into_its_plan(tmp_path):
    """Nothing initialised only to be overwritten: a run whose workdir holds a checkpoint is
    planned abstractly (each array a `ShapeDtypeStruct` with its planned sharding) and every
    array is then restored into that sharding, ending with the bits of a run never stopped."""
    mesh = {"fsdp": 4, "tensor": 2}
    whole = Trainer(config(deep_mlp.MODEL, tmp_path / "whole", mesh, "trainer.steps=4")).fit()
    zoo.run(config(deep_mlp.MODEL, tmp_path / "run", mesh, "trainer.steps=2"))
    trainer = Trainer(config(deep_mlp.MODEL, tmp_path / "run", mesh, "trainer.steps=4"))
    rows = {row.path: row for row in trainer.plan.rows}
    for path, variable in nnx.to_flat_state(trainer.state):
        leaf, name = variable.get_value(), ".".join(str(part) for part in path[1:])
        assert isinstance(leaf, jax.ShapeDtypeStruct), name
        assert leaf.sharding.spec == rows[name].spec, name
    resumed = trainer.fit()
    assert trainer.resumed_from == 2
    for ours, theirs in zip(jax.tree.leaves(resumed.state), jax.tree.leaves(whole.state)):
        assert jax.typeof(ours).sharding.spec == jax.typeof(theirs).sharding.spec
        np.testing.assert_array_equal(jax.device_get(ours), jax.device_get(theirs))


def test_a_long_evaluation_on_eight_devices_ends(tmp_path):
    """128 eval batches of a tiny gpt, split over 8 devices: queued all at once, jaxlib 0.10's
    XLA:CPU left devices out of an eval step's all-reduce and aborted the run."""
    tiny = [key for key in registry.get_model("gpt").tiny if not key.startswith("data.eval_bytes")]
    result = run_cli(
        "model=gpt",
        *tiny,
        "data.eval_bytes=65536",
        "trainer.steps=1",
        f"workdir={tmp_path}",
        devices=8,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Sharding plan on mesh data=8" in result.stderr
    assert len(read_events(tmp_path).Scalars("val/loss")) == 1

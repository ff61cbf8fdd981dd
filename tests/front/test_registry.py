"""The model registry: built-ins, user registrations, and the config derived from signatures."""

from __future__ import annotations

import dataclasses

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from zoo.engine import registry
from zoo.models.xor import XorClassifier, binary_classification_loss

import zoo
from zoo.pretrained import families_help


class Tiny(nnx.Module):
    def __init__(self, width: int = 4, scale: float = 1.0, *, rngs: nnx.Rngs):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
        self.layer = nnx.Linear(2, width, kernel_init=init, rngs=rngs)
        self.scale = scale

    def __call__(self, x):
        return self.layer(x)[:, :1] * self.scale


if "tiny" not in zoo.list_models():
    zoo.register_model("tiny", Tiny, loss=binary_classification_loss, default_data="xor")


@dataclasses.dataclass(frozen=True)
class TinyOptions:
    width: int = 4
    scale: float = 1.0

    def __post_init__(self):
        if self.width < 1:
            raise zoo.ZooError(f"model.width={self.width} must be at least 1.")


class TinyOfOptions(Tiny):
    """`Tiny` built from one typed object of options."""

    def __init__(self, options: TinyOptions, *, rngs: nnx.Rngs):
        super().__init__(options.width, options.scale, rngs=rngs)


if "tiny_options" not in zoo.list_models():
    zoo.register_model(
        "tiny_options", TinyOfOptions, loss=binary_classification_loss, default_data="xor"
    )


@dataclasses.dataclass(frozen=True)
class Required:
    width: int  # no default: no config key


class OfRequired(nnx.Module):
    def __init__(self, options: Required, *, rngs: nnx.Rngs):
        pass


def test_list_models_holds_builtins_and_user_models():
    assert "xor" in zoo.list_models() and "tiny" in zoo.list_models()
    assert zoo.list_models() == sorted(zoo.list_models())
    assert "xor" in zoo.list_datasets()


def test_list_models_says_which_checkpoint_families_each_model_loads():
    from zoo.engine.registry import Family, Rule, register_family

    if not any(f.name == "tiny-ckpt" for f in registry.families("tiny")):
        register_family(
            Family(
                name="tiny-ckpt",
                model="tiny",
                matches=lambda config: config.get("model_type") == "tiny-ckpt",
                hparams=lambda config: {"width": config["width"]},
                rules=[Rule(r"layer\.weight", ("layer.kernel",))],
                description="Tiny, a test layout",
            )
        )
    loads = zoo.list_models(families=True)
    assert list(loads) == zoo.list_models()
    assert loads["tiny"] == ["tiny-ckpt: Tiny, a test layout"]
    assert loads["gpt"] == ["gpt2: GPT-2, transformers GPT2LMHeadModel"]
    assert loads["xor"] == []
    assert "  tiny: tiny-ckpt: Tiny, a test layout\n" in families_help()


def test_create_model_applies_overrides_with_params_born_sharded():
    model = zoo.create_model("xor", num_hidden=16, seed=3)
    assert isinstance(model, XorClassifier)
    kernel = model.hidden.kernel[...]
    assert kernel.shape == (2, 16)
    assert jax.typeof(kernel).sharding.spec == P(None, "tensor")
    again = zoo.create_model("xor", num_hidden=16, seed=3)
    assert (again.hidden.kernel[...] == kernel).all()


def test_create_model_rejects_unknown_names_and_parameters():
    with pytest.raises(zoo.ZooError, match="Unknown model 'nope'.*xor"):
        zoo.create_model("nope")
    with pytest.raises(zoo.ZooError, match="'depth'.*num_hidden"):
        zoo.create_model("xor", depth=3)
    with pytest.raises(zoo.ZooError, match="model 'xor'.*'wide'"):
        zoo.create_model("xor", num_hidden="wide")


def test_user_model_gets_a_typed_config_the_cli_accepts():
    cfg = zoo.compose(["model=tiny", "model.width=8", "model.scale=0.5"])
    assert cfg.model.width == 8 and cfg.model.scale == 0.5 and cfg.data.name == "xor"
    with pytest.raises(zoo.ZooError, match="model.width=big"):
        zoo.compose(["model=tiny", "model.width=big"])
    assert zoo.create_model("tiny", width=8).layer.kernel.shape == (2, 8)


def test_a_model_may_take_its_options_as_one_typed_object():
    assert registry.options_parameters(TinyOfOptions) == {"options": TinyOptions}
    assert registry.options_parameters(Tiny) == {}
    cfg = zoo.compose(["model=tiny_options", "model.width=8", "model.scale=0.5"])
    assert cfg.model.width == 8 and cfg.model.scale == 0.5
    with pytest.raises(zoo.ZooError, match="model.width=big"):
        zoo.compose(["model=tiny_options", "model.width=big"])
    model = zoo.create_model("tiny_options", width=8, scale=0.5)
    assert model.layer.kernel.shape == (2, 8) and model.scale == 0.5
    with pytest.raises(zoo.ZooError, match="model.width=0 must be at least 1"):
        zoo.create_model("tiny_options", width=0)


def _load_with_options(path: str = "here", *, options: TinyOptions):
    return path, options


if "tiny_options_data" not in zoo.list_datasets():
    zoo.register_data("tiny_options_data", _load_with_options)


def test_a_data_set_may_take_a_group_of_its_keys_as_one_typed_object():
    entry = registry.get_data("tiny_options_data")
    keys = [field.name for field in dataclasses.fields(entry.config)]
    assert keys == ["name", "path", "width", "scale"]  # the loader's own, then the group's
    assert entry.splits({"name": "tiny_options_data", "path": "x", "width": 3}) == (
        "x",
        TinyOptions(width=3, scale=1.0),
    )
    with pytest.raises(zoo.ZooError, match="model.width=0 must be at least 1"):
        entry.splits({"path": "x", "width": 0})


def test_model_defaults_apply_and_command_line_overrides_them():
    cfg = zoo.compose(["model=xor"])
    assert (cfg.trainer.steps, cfg.trainer.batch_size) == (2000, 128)
    assert (cfg.optimizer.name, cfg.optimizer.learning_rate) == ("sgd", 0.1)
    overrides = ["model=xor", "trainer.steps=5", "trainer.steps_per_dispatch=1"]
    assert zoo.compose(overrides).trainer.steps == 5
    assert zoo.compose(["model=tiny"]).optimizer.name == "adam"  # the schema default


def test_registration_errors_are_clear():
    with pytest.raises(zoo.ZooError, match="already registered"):
        zoo.register_model("xor", Tiny, loss=binary_classification_loss, default_data="xor")

    class Untyped(nnx.Module):
        def __init__(self, width=4, *, rngs):
            pass

    with pytest.raises(zoo.ZooError, match="'width'.*type hint and a default"):
        zoo.register_model("untyped", Untyped, loss=binary_classification_loss, default_data="xor")
    assert "untyped" not in zoo.list_models()

    with pytest.raises(zoo.ZooError, match="'width' of .*Required needs a type hint and a def"):
        zoo.register_model(
            "required", OfRequired, loss=binary_classification_loss, default_data="xor"
        )
    assert "required" not in zoo.list_models()

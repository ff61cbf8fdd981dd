"""The command line in real subprocesses: training, --help, --cfg job, and bad input."""

from __future__ import annotations

import importlib
import os
import textwrap

import pytest
from helpers import read_events, run_cli, scalar_steps

CHATTER = ("[absl]", "CheckpointManager", "Unable to initialize backend", "orbax", "[INFO]")


@pytest.fixture(scope="module")
def xor_run(tmp_path_factory):
    """The README's main job with its defaults: the tutorial's 2,000 SGD steps, 50 per dispatch."""
    workdir = tmp_path_factory.mktemp("xor")
    result = run_cli("model=xor", f"workdir={workdir}")
    return workdir, result


def test_xor_trains_to_tutorial_accuracy(xor_run):
    workdir, result = xor_run
    assert result.returncode == 0, result.stderr
    events = read_events(workdir)
    final_accuracy = scalar_steps(events, "val/accuracy")
    assert list(final_accuracy) == [2000]
    assert final_accuracy[2000] >= 0.99
    assert "Final eval @ step 2000" in result.stderr


def test_xor_run_writes_events_checkpoint_and_log(xor_run):
    workdir, _ = xor_run
    tags = read_events(workdir).Tags()["scalars"]
    for tag in (
        "train/loss",
        "train/accuracy",
        "val/loss",
        "val/accuracy",
        "vitals/learning_rate",
        "vitals/steps_per_sec",
    ):
        assert tag in tags
    assert os.path.isdir(workdir / "checkpoints" / "2000")
    assert (workdir / "train.log").stat().st_size > 0


def test_console_shows_own_lines_only(xor_run):
    workdir, result = xor_run
    console = result.stdout + result.stderr
    assert "Training xor on xor" in console
    for chatter in CHATTER:
        assert chatter not in console, chatter
    # The chatter is not lost: it goes to the log file in the workdir.
    assert "[absl][INFO]" in (workdir / "train.log").read_text()


def test_help_lists_models_and_datasets():
    result = run_cli("--help")
    assert result.returncode == 0
    assert "model: cnn, decoder, gpt, mlp, resnet, siglip, vae, vit, xor" in result.stdout
    assert (
        "data: arrayrecord, chat, cifar10, digits, fashion_mnist, images, mnist, parquet, "
        "preference, prompts, shape_captions, text, xor" in result.stdout
    )
    assert "  gpt: gpt2: GPT-2, transformers GPT2LMHeadModel\n" in result.stdout
    assert "  decoder: qwen3: Qwen 3, transformers Qwen3ForCausalLM\n" in result.stdout
    assert "trainer.steps" in result.stdout or "steps: 2000" in result.stdout


def test_cfg_job_prints_resolved_config_with_overrides():
    result = run_cli(
        "model=xor",
        "trainer.steps=7",
        "trainer.steps_per_dispatch=1",
        "optimizer.name=adam",
        "--cfg",
        "job",
    )
    assert result.returncode == 0, result.stderr
    for line in (
        "steps: 7",
        "name: adam",
        "batch_size: 128",
        "learning_rate: 0.1",
        "train_size: 2500",
        "fsdp: 1",
        "seed: 0",
    ):
        assert line in result.stdout


@pytest.mark.parametrize(
    ("override", "names"),
    [
        ("model=resnet9000", ["resnet9000", "xor"]),
        ("data=imagenet", ["imagenet", "xor"]),
        ("trainer.stepz=5", ["trainer.stepz", "steps", "batch_size"]),
        ("+trainer.extra=5", ["trainer.extra", "steps"]),
        ("model.num_hiden=4", ["num_hiden", "num_hidden"]),
        ("trainer.steps=many", ["many", "Integer"]),
        ("optimizer.name=lion", ["lion", "sgd", "adam", "adamw"]),
        ("trainer.batch_size=0", ["batch_size=0", "at least 1"]),
        ("trainer.profile_steps=[5]", ["profile_steps=[5]", "[first, last]", "trainer.steps"]),
        ("trainer.profile_steps=[9,3]", ["profile_steps=[9, 3]", "first <= last"]),
        ("logging.histogram_every=-1", ["histogram_every=-1", "0 (off) or positive"]),
        ("logging.norms_every=-5", ["norms_every=-5", "0 (off) or positive"]),
        ("logging.histograms=5", ["logging.histograms", "histogram_every"]),
    ],
)
def test_bad_input_is_one_paragraph_and_keeps_existing_files(tmp_path, override, names):
    existing = tmp_path / "train.log"
    existing.write_text("an earlier run's log\n")
    result = run_cli(override, f"workdir={tmp_path}")
    assert result.returncode == 2
    message = result.stderr.strip()
    assert message.startswith("error: ")
    assert "\n" not in message and "Traceback" not in message, message
    for name in names:
        assert name in message
    assert existing.read_text() == "an earlier run's log\n"
    assert sorted(os.listdir(tmp_path)) == ["train.log"]


def test_user_model_registered_through_plugin_module(tmp_path):
    plugin = tmp_path / "my_models.py"
    plugin.write_text(
        textwrap.dedent("""
        from flax import nnx
        import zoo
        from zoo.models.xor import binary_classification_loss

        class Wide(nnx.Module):
            def __init__(self, width: int = 32, *, rngs: nnx.Rngs):
                init = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, None))
                zeros = nnx.with_partitioning(nnx.initializers.zeros_init(), (None,))
                self.hidden = nnx.Linear(2, width, kernel_init=init, bias_init=zeros, rngs=rngs)
                self.out = nnx.Linear(width, 1, kernel_init=init, bias_init=zeros, rngs=rngs)

            def __call__(self, x):
                return self.out(nnx.relu(self.hidden(x)))

        zoo.register_model("wide", Wide, loss=binary_classification_loss, default_data="xor")
    """)
    )
    workdir = tmp_path / "run"
    env = {"ZOO_PLUGINS": "my_models", "PYTHONPATH": str(tmp_path)}
    result = run_cli(
        "model=wide",
        "model.width=16",
        "trainer.steps=300",
        "optimizer.learning_rate=0.01",
        f"workdir={workdir}",
        env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "Training wide on xor" in result.stderr
    assert scalar_steps(read_events(workdir), "val/accuracy")[300] >= 0.9


def test_run_time_error_exits_non_zero_and_keeps_checkpoints(tmp_path):
    checkpoint = tmp_path / "checkpoints" / "100"
    checkpoint.mkdir(parents=True)
    (checkpoint / "marker").write_text("kept")
    result = run_cli("mesh.data=16", f"workdir={tmp_path}", devices=8)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "data=16" in result.stderr and "8 are available" in result.stderr
    assert (checkpoint / "marker").read_text() == "kept"


FASHION_MNIST = "/usr/share/datasets/fashion-mnist"


@pytest.mark.skipif(
    not os.path.isdir(FASHION_MNIST),
    reason=f"no {FASHION_MNIST}: Debian's package dataset-fashion-mnist provides it",
)
def test_cnn_trains_on_the_real_fashion_mnist(tmp_path):
    """End to end: the model's default data set, found where Debian installs it."""
    result = run_cli(
        "model=cnn",
        "model.channels=[4,8,8]",
        "trainer.steps=30",
        "trainer.batch_size=256",
        "trainer.log_every=10",
        "optimizer.warmup_steps=0",
        "optimizer.learning_rate=0.01",
        f"workdir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr
    assert "Training cnn on fashion_mnist" in result.stderr
    assert scalar_steps(read_events(tmp_path), "val/accuracy")[30] > 0.4  # chance: 0.1


@pytest.mark.parametrize(
    ("command", "module"),
    [(c, f"zoo.{c}") for c in ("generate", "chat", "export", "eval")]
    + [("serve", "zoo.serve.__main__")],
)
def test_every_other_command_names_what_it_does_not_take(command, module, capsys):
    """The commands other than zoo.train read their arguments alike (`zoo.cli.command_line`):
    an option they do not take, or a wrong count of positional arguments, is named, followed by
    the usage, with exit status 2, before anything is loaded."""
    main = importlib.import_module(module).main
    assert main(["somewhere", "else", "here", "bogus=1"]) == 2
    said = capsys.readouterr().err
    assert said.startswith("error: bogus=1: not an option of this command, which takes "), said
    assert f"\nusage: python -m zoo.{command} " in said
    assert main([]) == 2
    said = capsys.readouterr().err
    assert "is missing" in said or "positional argument(s) expected" in said, said

"""Every command line imports the modules named in `ZOO_PLUGINS` (`zoo.cli.load_plugins`): a
run of a model that a project's own module registers is trained by `python -m zoo.train`, then
loaded by `zoo.generate`, `zoo.export` and `zoo.chat` in processes of their own; a module that
cannot be imported is refused by name by each (and by `zoo.eval` and `zoo.serve`), and a run whose model no module registered says
how to register it."""

from __future__ import annotations

import importlib
import textwrap

import pytest
from helpers import TINY_TEXT, run_cli, run_module

import zoo

PLUGIN = textwrap.dedent('''
    """A project's own language model: zoo's GPT, registered under a name of its own."""
    import zoo

    gpt = zoo.get_model("gpt")
    zoo.register_model("my_gpt", gpt.constructor, loss=gpt.loss, default_data="text")
''')
PLUGINS = {"ZOO_PLUGINS": "my_models"}
TINY = (
    "model.context_length=32",
    "model.dim=32",
    "model.depth=1",
    "model.num_heads=2",
    "model.mlp_ratio=2",
    f"data.path={TINY_TEXT}",
    "data.window=16",
    "trainer.steps=2",
    "trainer.batch_size=8",
    "trainer.eval_every=2",
)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A project folder holding the plugin module, and a run of its model trained there by the
    command line with `ZOO_PLUGINS=my_models` (the folder is the current directory)."""
    folder = tmp_path_factory.mktemp("my_project")
    (folder / "my_models.py").write_text(PLUGIN)
    done = run_cli("model=my_gpt", *TINY, "workdir=run", env=PLUGINS, cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Training my_gpt on text" in done.stderr
    return folder


COMMANDS = {
    "generate": (("run", "prompt=The", "max_new_tokens=4", "temperature=0"), None),
    "export": (("run", "exported", "format=jax"), None),
    # The run is no chat checkpoint: its model loaded, the chat refuses it for that.
    "chat": (("run",), "needs a chat checkpoint"),
}


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_loads_a_model_that_a_plugin_registers(project, command):
    arguments, refusal = COMMANDS[command]
    done = run_module(f"zoo.{command}", *arguments, env=PLUGINS, cwd=project)
    if refusal is None:
        assert done.returncode == 0, done.stderr[-3000:]
    else:
        assert done.returncode == 2 and refusal in done.stderr, done.stderr[-3000:]
    assert "Unknown model" not in done.stderr
    if command == "generate":
        assert done.stdout.startswith("The") and len(done.stdout) > len("The\n")
    if command == "export":
        assert (project / "exported" / "model.jaxexport").is_file()


ARGUMENTS = {
    "generate": ["run", "prompt=The"],
    "export": ["run", "out"],
    "chat": ["run"],
    "eval": ["run", "tasks=hellaswag"],
    "serve": ["run"],
}


@pytest.mark.parametrize("command", ["generate", "export", "chat", "eval", "serve", "train"])
def test_each_command_refuses_a_plugin_module_it_cannot_import(command, monkeypatch, capsys):
    monkeypatch.setenv("ZOO_PLUGINS", "no_such_plugin_module")
    module = "zoo.serve.__main__" if command == "serve" else f"zoo.{command}"
    main = importlib.import_module(module).main
    try:
        status = main(ARGUMENTS.get(command, ["model=xor"]))
    except SystemExit as e:  # the training command exits
        status = e.code
    assert status == 2
    said = capsys.readouterr().err
    assert "Cannot import plugin module 'no_such_plugin_module' named in $ZOO_PLUGINS" in said


def test_a_run_of_a_model_no_module_registered_says_how_to_register_it(project):
    with pytest.raises(zoo.ZooError, match="Unknown model 'my_gpt'.*ZOO_PLUGINS=MODULE"):
        zoo.load(project / "run")

"""zoo as an lm-evaluation-harness model: the harness's tasks give through zoo's model the
log-likelihoods, rolling log-likelihoods, replies and metrics that its own Hugging Face backend
gives on the same checkpoint in transformers (tests/fixtures/lm_eval/make_lm_eval.py wrote
them: a tiny Qwen 3 and a tiny Llama 3, whose tokenizer prepends BOS; local tasks); `zoo.evaluate_lm`, `python -m zoo.eval` and the training
callback write the metrics as JSON and to TensorBoard."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import ROOT, TINY_TEXT_FINETUNE, read_events, run_cli, run_module, scalar_steps
from lm_eval import simple_evaluate
from lm_eval.api.registry import get_model
from lm_eval.tasks import TaskManager
from zoo.data.text import load_tokenizer

import zoo
from zoo.lm_harness import ZooLM

FIXTURES = ROOT / "tests" / "fixtures"
QWEN3 = FIXTURES / "pretrained" / "qwen3-chat"
LM_EVAL = FIXTURES / "lm_eval"
REFERENCE = json.loads((LM_EVAL / "reference.json").read_text())
QWEN3_REFERENCE = REFERENCE["checkpoints"]["qwen3-chat"]
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """The reference's tasks as YAML files (JSON is YAML) naming their data by absolute path."""
    folder = tmp_path_factory.mktemp("tasks")
    for name, config in REFERENCE["tasks"].items():
        files = config["dataset_kwargs"]["data_files"]
        placed = {split: str(LM_EVAL / path) for split, path in files.items()}
        text = json.dumps({**config, "dataset_kwargs": {"data_files": placed}})
        (folder / f"{name}.yaml").write_text(text)
    return folder


@pytest.fixture(scope="module")
def qwen3():
    return zoo.load(QWEN3, devices=jax.devices()[:1])


def harness_run(lm: ZooLM, names: list[str], tasks) -> dict:
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    return simple_evaluate(model=lm, tasks=names, log_samples=True, task_manager=manager)


def answers(results: dict, task: str) -> list:
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [[resp[0] for resp in sample["resps"]] for sample in samples]


@pytest.fixture(scope="module", params=list(REFERENCE["checkpoints"]))
def checkpoint(request):
    """(its reference answers, the checkpoint loaded on one device)."""
    loaded = zoo.load(FIXTURES / "pretrained" / request.param, devices=jax.devices()[:1])
    return REFERENCE["checkpoints"][request.param], loaded


@pytest.fixture(scope="module")
def short(checkpoint, tasks):
    lm = ZooLM(checkpoint[1], batch_size=4)
    return checkpoint[0], harness_run(lm, ["tiny_choice", "tiny_generate"], tasks)


@pytest.fixture(scope="module")
def rolling(checkpoint, tasks):
    lm = ZooLM(checkpoint[1], batch_size=4, max_length=REFERENCE["rolling_max_length"])
    return checkpoint[0], harness_run(lm, ["tiny_rolling"], tasks)


def test_loglikelihoods_and_accuracy_equal_the_harness_hf_backend(short):
    reference, short = short
    mine, theirs = answers(short, "tiny_choice"), reference["tiny_choice"]["requests"]
    assert len(mine) == len(theirs) == 8
    for question, expected in zip(mine, theirs, strict=True):
        np.testing.assert_allclose(
            [ll for ll, _ in question], [ll for ll, _ in expected], atol=TOLERANCE
        )
        assert [greedy for _, greedy in question] == [greedy for _, greedy in expected]
    for metric, value in reference["tiny_choice"]["metrics"].items():
        assert abs(short["results"]["tiny_choice"][f"{metric},none"] - value) <= TOLERANCE


def test_rolling_loglikelihoods_over_several_windows_equal_the_harness(rolling):
    reference, rolling = rolling
    mine = [ll for (ll,) in answers(rolling, "tiny_rolling")]
    theirs = [ll for (ll,) in reference["tiny_rolling"]["requests"]]
    np.testing.assert_allclose(mine, theirs, atol=TOLERANCE)
    got, expected = rolling["results"]["tiny_rolling"], reference["tiny_rolling"]["metrics"]
    assert abs(got["bits_per_byte,none"] - expected["bits_per_byte"]) <= TOLERANCE
    np.testing.assert_allclose(got["word_perplexity,none"], expected["word_perplexity"], rtol=1e-5)


def test_generate_until_replies_are_zoo_generate_greedy_and_the_harness(short, checkpoint):
    """zoo.generate's greedy reply, as the harness's hf backend gives it: without the special
    tokens it wrote (the tiny Llama writes `<|end_header_id|>`), cut at the first stop."""
    reference, short = short
    prompts = [json.loads(line)["prompt"] for line in (LM_EVAL / "prompts.jsonl").open()]
    settings = REFERENCE["tasks"]["tiny_generate"]["generation_kwargs"]
    until, tokenizer = settings["until"], load_tokenizer(checkpoint[1].config.data.tokenizer)
    done = zoo.generate(
        checkpoint[1], prompts, settings["max_gen_toks"], 0.0, stop=until, logprobs=True
    )
    replies = []
    for row in done:
        text = tokenizer.decode(row.tokens, skip_special_tokens=True)
        replies.append(min((text.split(stop)[0] for stop in until), key=len))
    mine = [reply for (reply,) in answers(short, "tiny_generate")]
    assert mine == replies == [reply for (reply,) in reference["tiny_generate"]["requests"]]


def test_on_a_mesh_of_every_device_the_loglikelihoods_are_the_same(tasks):
    """Loaded on data=4 x tensor=2: each batch of 4 rows split over `data`, the vocabulary (and
    the heads) over `tensor`."""
    spread = zoo.load(QWEN3, mesh={"data": 4, "tensor": 2})
    spread = harness_run(ZooLM(spread, batch_size=4), ["tiny_choice"], tasks)
    np.testing.assert_allclose(
        [[ll for ll, _ in q] for q in answers(spread, "tiny_choice")],
        [[ll for ll, _ in q] for q in QWEN3_REFERENCE["tiny_choice"]["requests"]],
        atol=TOLERANCE,
    )


def test_bad_input_is_refused_by_name(qwen3, tasks, tmp_path):
    with pytest.raises(zoo.ZooError, match="tasks= names no task"):
        zoo.evaluate_lm(qwen3, " , ", include=tasks)
    with pytest.raises(zoo.ZooError, match="include='no_such_dir' is not a folder"):
        zoo.evaluate_lm(qwen3, "tiny_choice", include="no_such_dir")
    resnet = FIXTURES / "pretrained" / "resnet18-timm"
    with pytest.raises(zoo.ZooError, match="scores language models .* is a resnet"):
        zoo.evaluate_lm(resnet, "tiny_choice", include=tasks)
    beams = {**REFERENCE["tasks"]["tiny_generate"], "task": "beams"}
    beams["generation_kwargs"] = {"until": ["\n"], "num_beams": 4}
    beams["dataset_kwargs"] = {"data_files": {"test": str(LM_EVAL / "prompts.jsonl")}}
    (tmp_path / "beams.yaml").write_text(json.dumps(beams))
    with pytest.raises(zoo.ZooError, match="generation_kwargs 'num_beams' .* not options"):
        zoo.evaluate_lm(qwen3, "beams", include=tmp_path, limit=1)


WITHOUT_HARNESS = """
import sys
sys.modules["lm_eval"] = None  # as where the extra is not installed
import zoo
try:
    zoo.evaluate_lm("any", "hellaswag")
except zoo.ZooError as e:
    print(e)
try:
    zoo.compose(["model=gpt", "trainer.checkpoint_every=1", "lm_eval.tasks=[hellaswag]"])
except zoo.ZooError as e:
    print(e)
"""


def test_without_the_extra_zoo_imports_and_evaluate_lm_and_a_run_say_what_to_install():
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_HARNESS], capture_output=True, text=True, check=True
    )
    function, run = result.stdout.splitlines()
    assert function.startswith("zoo.evaluate_lm") and "pip install 'zoo[eval]'" in function
    assert run.startswith("lm_eval.tasks=[hellaswag] runs lm-evaluation-harness, which is not")
    assert "pip install 'zoo[eval]'" in run


def test_registered_with_the_harness_and_built_from_its_argument_string(qwen3):
    assert get_model("zoo") is ZooLM
    lm = ZooLM.create_from_arg_string(f"pretrained={QWEN3},max_length=64", {"batch_size": "2"})
    assert (lm.batch_size, lm.max_length, lm.prefix_token_id, lm.eot_token_id) == (2, 64, 381, 381)
    with pytest.raises(zoo.ZooError, match="batch_size='auto' is not a positive whole number"):
        ZooLM(qwen3, batch_size="auto")


def test_evaluate_lm_writes_json_and_tensorboard(qwen3, tasks, tmp_path):
    metrics = zoo.evaluate_lm(
        qwen3,
        "tiny_choice",
        include=tasks,
        output=tmp_path / "results.json",
        tensorboard=tmp_path / "events",
    )
    assert metrics == {"tiny_choice": QWEN3_REFERENCE["tiny_choice"]["metrics"]}
    written = json.loads((tmp_path / "results.json").read_text())
    assert written["metrics"] == metrics and written["step"] == 0
    events = read_events(tmp_path / "events")
    expected = QWEN3_REFERENCE["tiny_choice"]["metrics"]["acc_norm"]
    assert scalar_steps(events, "lm_eval/tiny_choice/acc_norm") == {0: pytest.approx(expected)}


def test_command_line_writes_json_and_tensorboard(tasks, tmp_path):
    result = run_module(
        "zoo.eval",
        QWEN3,
        "tasks=tiny_choice",
        f"include={tasks}",
        "limit=2",
        "num_fewshot=1",
        "batch_size=2",
        f"output={tmp_path / 'out.json'}",
        f"tensorboard={tmp_path}",
    )
    assert result.returncode == 0, result.stderr
    assert "tiny_choice acc 0" in result.stdout
    written = json.loads((tmp_path / "out.json").read_text())
    assert written["results"]["tiny_choice"]["sample_len"] == 2
    assert written["n-shot"] == {"tiny_choice": 1}
    assert scalar_steps(read_events(tmp_path), "lm_eval/tiny_choice/acc") == {0: 0.0}


def test_command_line_refuses_an_unknown_task_and_a_bad_option(tasks):
    misspelt = run_module("zoo.eval", QWEN3, "tasks=tiny_choise", f"include={tasks}")
    assert misspelt.returncode == 2
    assert "no task, group or tag named 'tiny_choise'" in misspelt.stderr
    assert "close names: tiny_choice" in misspelt.stderr
    bad = run_module("zoo.eval", QWEN3, "tasks=tiny_choice", "limit=many")
    assert bad.returncode == 2 and "limit='many' is not a number" in bad.stderr
    unknown = run_module("zoo.eval", QWEN3, "tasks=tiny_choice", "shots=3")
    assert unknown.returncode == 2 and "usage: python -m zoo.eval" in unknown.stderr


def test_callback_evaluates_a_run_at_its_checkpoints_into_its_tensorboard(tasks, tmp_path):
    callback = zoo.LMEvalCallback("tiny_choice", every=3, include=tasks, limit=2)
    result = zoo.fit(
        "decoder",
        f"finetune.init_from={QWEN3}",
        *TINY_TEXT_FINETUNE,
        "trainer.checkpoint_every=3",
        f"workdir={tmp_path}",
        callbacks=[callback],
    )
    assert list(callback.results) == [3]
    again = zoo.evaluate_lm(
        result.workdir, "tiny_choice", include=tasks, limit=2, tensorboard=False
    )
    assert callback.results[3] == again
    events = read_events(tmp_path)
    assert scalar_steps(events, "lm_eval/tiny_choice/acc") == {3: again["tiny_choice"]["acc"]}


RUN_WITH_TASKS = (
    "model=decoder",
    f"finetune.init_from={QWEN3}",
    *(a for a in TINY_TEXT_FINETUNE if not a.startswith(("trainer.steps=", "trainer.eval_every="))),
    "trainer.steps=4",
)
"""The tiny fine-tune of the callback's test, for four steps with one eval, after the last."""


def test_command_line_runs_the_lm_eval_section_at_its_checkpoints(tasks, tmp_path):
    """Checkpoints at each step; the tasks on every second one, into the run's TensorBoard."""
    result = run_cli(
        *RUN_WITH_TASKS,
        "trainer.checkpoint_every=1",
        "lm_eval.tasks=[tiny_choice]",
        "lm_eval.every=2",
        f"lm_eval.include=[{tasks}]",
        "lm_eval.limit=2",
        f"workdir={tmp_path}",
    )
    assert result.returncode == 0, result.stderr
    accuracy = scalar_steps(read_events(tmp_path), "lm_eval/tiny_choice/acc")
    assert list(accuracy) == [2, 4] and all(value in (0.0, 0.5, 1.0) for value in accuracy.values())
    assert "lm_eval at step 4: tiny_choice acc " in result.stdout + result.stderr


def test_command_line_refuses_an_lm_eval_every_between_checkpoints_before_writing(tmp_path):
    workdir = tmp_path / "run"
    result = run_cli(
        *RUN_WITH_TASKS,
        "trainer.checkpoint_every=2",
        "lm_eval.tasks=[tiny_choice]",
        "lm_eval.every=3",
        f"workdir={workdir}",
    )
    assert result.returncode == 2
    assert "lm_eval.every=3 must be a positive multiple of trainer.checkpoint_every=2" in (
        result.stderr
    )
    assert not workdir.exists()


TASK = ("lm_eval.tasks=[tiny_choice]", "lm_eval.include=[{tasks}]")


@pytest.mark.parametrize(
    "model, overrides, message",
    [
        (
            "decoder",
            ["lm_eval.tasks=[tiny_choise]", "lm_eval.include=[{tasks}]"],
            "no task, group or tag named 'tiny_choise'; close names: tiny_choice",
        ),
        ("mlp", TASK, "lm_eval.tasks=[tiny_choice] scores a language model, and model 'mlp' is"),
        ("decoder", ["lm_eval.every=2"], "lm_eval.every=2 applies to the tasks of lm_eval.tasks"),
        (
            "decoder",
            ["lm_eval.tasks=[tiny_choice]", "lm_eval.include={tasks}"],
            "The key takes a list: lm_eval.include=[",
        ),
    ],
    ids=["unknown task", "not a language model", "no tasks", "include not a list"],
)
def test_fit_refuses_the_lm_eval_section_before_building(
    model, overrides, message, tasks, tmp_path
):
    start = [f"finetune.init_from={QWEN3}"] if model == "decoder" else []
    with pytest.raises(zoo.ZooError, match=re.escape(message)):
        zoo.fit(
            model,
            *start,
            "trainer.checkpoint_every=2",
            *(override.format(tasks=tasks) for override in overrides),
            f"workdir={tmp_path / 'run'}",
        )
    assert not (tmp_path / "run").exists()


def test_fit_refuses_lm_eval_tasks_without_checkpoints(tasks, tmp_path):
    with pytest.raises(zoo.ZooError, match=re.escape("trainer.checkpoint_every=0 saves one only")):
        zoo.fit(
            "decoder",
            f"finetune.init_from={QWEN3}",
            *(override.format(tasks=tasks) for override in TASK),
            f"workdir={tmp_path / 'run'}",
        )
    assert not (tmp_path / "run").exists()


def close(again, committed, where: str = "reference") -> None:
    """JSON values equal, numbers within 1e-6."""
    if isinstance(committed, dict):
        assert again.keys() == committed.keys(), where
        for key in committed:
            close(again[key], committed[key], f"{where}.{key}")
    elif isinstance(committed, list):
        assert len(again) == len(committed), where
        for i, (a, c) in enumerate(zip(again, committed, strict=True)):
            close(a, c, f"{where}[{i}]")
    elif isinstance(committed, float):
        assert again == pytest.approx(committed, abs=1e-6), where
    else:
        assert again == committed, where


@pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("torch", "transformers")),
    reason="needs torch and transformers",
)
def test_the_reference_regenerates(tmp_path):
    """The committed script, run again in the reference environment, writes reference.json."""
    spec = importlib.util.spec_from_file_location("make_lm_eval", LM_EVAL / "make_lm_eval.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    maker.main(tmp_path)
    close(json.loads((tmp_path / "reference.json").read_text()), REFERENCE)

"""Reward functions: the built-ins score real completions as documented, `module:function`
names import a real module (and are refused, saying why, when they cannot), and `score`
names every bad value a function gives (raised, or skipped with a warning); the metrics are
each function's over what it scored."""

from __future__ import annotations

import logging
import math
import re

import numpy as np
import pytest
from zoo.engine.errors import ZooError
from zoo.engine.posttraining.rewards import (
    BUILTIN_REWARDS,
    RewardError,
    exact_match,
    format_match,
    length_penalty,
    numeric_match,
    resolve_reward,
    reward_metrics,
    reward_names,
    score,
)

MY_REWARDS = """
def brevity(prompts, completions, completion_lengths, **columns):
    return [1.0 / n for n in completion_lengths]

not_a_function = 3
"""


def call(fn, completions, **columns):
    return fn(["Q"] * len(completions), completions, **columns)


# --- the built-ins ---------------------------------------------------------------------------


def test_exact_match_compares_stripped_text_with_the_answer_as_text():
    completions = ["  Paris\n", "paris", "42", "Paris is the capital"]
    answers = ["Paris", "Paris", 42, "Paris"]
    assert call(exact_match, completions, answer=answers) == [1.0, 0.0, 1.0, 0.0]


def test_numeric_match_takes_the_last_number_of_the_completion():
    completions = [
        "3 apples and 4 pears make 7",
        "It costs $1,234.50 in all.",
        "x = -12",
        "10-5 is the range, so 5",
        "The answer is 0.30000001",
        "It is 8, not 7.",
        "I do not know.",
        "1,2345",
    ]
    answers = ["7", 1234.5, "-12", "5", "0.3", 8, "3", "2345"]
    assert call(numeric_match, completions, answer=answers) == [1, 1, 1, 1, 1, 0, 0, 1]


def test_numeric_match_leaves_a_completion_unscored_where_the_answer_is_no_number():
    answers = ["Paris", float("nan"), True, "7 apples"]
    assert call(numeric_match, ["7"] * 4, answer=answers) == [None] * 4


def test_format_match_needs_the_whole_completion_to_match():
    exclaims = format_match(r"[A-Z].*!")
    assert exclaims.__name__ == "format_match"
    assert call(exclaims, ["Hi!", "Hi! there", "hi!", "Two\nlines!"]) == [1.0, 0.0, 0.0, 1.0]


def test_the_format_builtin_wants_thoughts_then_an_answer():
    fmt = resolve_reward("format")
    assert fmt.__name__ == "format"
    completions = [
        "<think>\n6 times 7\n</think>\n42",
        "<think></think>42",
        "42",
        "<think>6 times 7</think>",
        "<think>6 times 7</think>  \n",
        "Sure. <think>x</think> 42",
    ]
    assert call(fmt, completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_format_match_refuses_a_pattern_that_is_no_regular_expression():
    with pytest.raises(ZooError, match=r"pattern '<think>\(' is not a regular expression"):
        format_match("<think>(")


def test_length_penalty_ramps_from_zero_to_minus_one_over_the_cache():
    penalty = length_penalty(max_completion_length=100, cache=20)
    lengths = [1, 80, 85, 90, 100, 101]
    rewards = call(penalty, [""] * 6, completion_lengths=lengths)
    assert rewards == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert penalty.__name__ == "length_penalty"


def test_length_penalty_without_cache_punishes_only_overlong_completions():
    penalty = length_penalty(max_completion_length=10, cache=0)
    assert call(penalty, [""] * 3, completion_lengths=[0, 10, 11]) == [0.0, 0.0, -1.0]


@pytest.mark.parametrize("lengths", [(10, 11), (0, 0), (10, -1), (10.0, 2), (True, 0)])
def test_length_penalty_refuses_lengths_that_make_no_ramp(lengths):
    with pytest.raises(ZooError, match=r"length_penalty\(max_completion_length="):
        length_penalty(*lengths)


def test_a_builtin_names_the_column_it_misses():
    with pytest.raises(
        RewardError,
        match=r"'exact_match' cannot score the completions of prompt "
        r"row a.jsonl:0: exact_match reads the column 'answer'.*: solution",
    ):
        score([exact_match], ["Q"], ["4"], {"solution": ["4"]}, ["a.jsonl:0"])


# --- resolving names -------------------------------------------------------------------------


@pytest.fixture
def my_rewards(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(MY_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_a_module_function_is_imported(my_rewards):
    brevity = resolve_reward("my_rewards:brevity")
    assert brevity.__name__ == "brevity"
    assert call(brevity, ["ab", "abcd"], completion_lengths=[2, 4]) == [0.5, 0.25]


def test_builtins_resolve_by_name():
    assert resolve_reward("exact_match") is exact_match
    assert resolve_reward(" numeric_match ") is numeric_match
    penalty = resolve_reward("length_penalty", max_completion_length=8, length_cache=4)
    assert call(penalty, ["", ""], completion_lengths=[4, 6]) == [0.0, -0.5]
    assert set(BUILTIN_REWARDS) == {"exact_match", "numeric_match", "format", "length_penalty"}


def test_a_callable_is_used_as_it_is():
    def mine(prompts, completions, **columns):
        return [0.0] * len(completions)

    assert resolve_reward(mine) is mine


@pytest.mark.parametrize(
    "spec, message",
    [
        ("exact", r"no built-in reward function 'exact'.*exact_match, numeric_match, format"),
        ("my_rewards.brevity", r"'my_rewards.brevity' is neither a built-in's name nor"),
        ("my_rewards:", r"'my_rewards:' is neither"),
        ("a:b:c", r"'a:b:c' is neither"),
        ("no_such_module:f", r"Cannot import module 'no_such_module'.*ModuleNotFoundError"),
        ("my_rewards:brevty", r"'my_rewards' has no 'brevty' \(did you mean brevity\?\)"),
        ("my_rewards:not_a_function", r"'my_rewards:not_a_function' is 3 \(of type int\), not a"),
        ("length_penalty", r"length_penalty needs the run's max_completion_length"),
    ],
)
def test_what_names_no_reward_function_is_refused(my_rewards, spec, message):
    with pytest.raises(ZooError, match=message):
        resolve_reward(spec)


def test_a_module_that_fails_to_import_is_refused_saying_why(my_rewards):
    (my_rewards / "broken_rewards.py").write_text("import math\nraise RuntimeError('no GPU')\n")
    with pytest.raises(ZooError, match=r"'broken_rewards'.*RuntimeError: no GPU"):
        resolve_reward("broken_rewards:f")


def test_what_is_neither_a_name_nor_callable_is_refused():
    with pytest.raises(ZooError, match=r"3 is not a reward function"):
        resolve_reward(3)


# --- scoring ---------------------------------------------------------------------------------

ROWS = ["train.jsonl:0", "train.jsonl:0", "train.jsonl:1", "train.jsonl:1"]
COMPLETIONS = ["4", "5", "Paris", "paris"]
COLUMNS = {
    "answer": ["4", "4", "Paris", "Paris"],
    "completion_lengths": [1, 1, 2, 2],
    "truncated": [False, False, False, True],
}


def returning(value):
    """A reward function that returns `value`, whatever the completions."""

    def returns(prompts, completions, **columns):
        return value

    return returns


def test_score_gives_each_function_a_column_with_nan_where_it_gave_none():
    def only_truncated(prompts, completions, truncated, **columns):
        return [-1 if t else None for t in truncated]

    numpy_and_bools = returning([np.int64(4), np.float32(4.5), True, 0])
    an_array = returning(np.array([0.5, 1, 2, 3]))
    functions = [exact_match, numeric_match, only_truncated, numpy_and_bools, an_array]
    rewards = score(functions, ["Q"] * 4, COMPLETIONS, COLUMNS, ROWS)
    assert rewards.dtype == np.float32
    expected = [
        [1, 1, np.nan, 4, 0.5],
        [0, 0, np.nan, 4.5, 1],
        [1, None, np.nan, 1, 2],
        [0, None, -1, 0, 3],
    ]
    np.testing.assert_array_equal(rewards, np.array(expected, dtype=float).astype(np.float32))


def raises(prompts, completions, **columns):
    return [float(c) for c in completions]


BAD = [
    (raises, r"'raises' raised ValueError: could not convert string to float: 'Paris' \(at "),
    (returning(1.0), r"'returns' returned 1.0 \(of type float\), not a list"),
    (returning("1111"), r"'returns' returned '1111' \(of type str\), not a list"),
    (returning({"a": 1}), r"returned \{'a': 1\} \(of type dict\), not a list"),
    (returning([1.0] * 3), r"'returns' returned 3 values for 4 completions"),
    (
        returning([1, 1, float("nan"), 1]),
        r"returned nan \(not finite in float32\) for completion 2",
    ),
    (returning([1, 1, 1, -math.inf]), r"returned -inf \(not finite in float32\) for completion 3"),
    (returning([1, 1, 1, 1e39]), r"returned 1e\+39 \(not finite in float32\)"),
    (returning([1, 1, "1", 1]), r"returned '1' \(a str, not a number\) for completion 2"),
    (returning([1, 1, 1, [1]]), r"returned \[1\] \(a list, not a number\) for completion 3"),
]


@pytest.mark.parametrize("fn, message", BAD, ids=[m for _, m in BAD])
def test_a_bad_value_is_named_and_raised(fn, message):
    with pytest.raises(RewardError, match=message) as raised:
        score([exact_match, fn], ["Q"] * 4, COMPLETIONS, COLUMNS, ROWS)
    assert "train.jsonl:1" in str(raised.value)
    assert "one value per completion" in str(raised.value) or "must not raise" in str(raised.value)


@pytest.mark.parametrize("fn, message", BAD, ids=[m for _, m in BAD])
def test_a_bad_value_is_skipped_with_a_warning(fn, message, caplog):
    with caplog.at_level(logging.WARNING, logger="zoo"):
        rewards = score([exact_match, fn], ["Q"] * 4, COMPLETIONS, COLUMNS, ROWS, "skip")
    np.testing.assert_array_equal(rewards[:, 0], [1, 0, 1, 0])
    assert np.isnan(rewards[:, 1]).all()
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert re.search(message, record.getMessage())
    assert f"With on_error=skip, '{fn.__name__}' scores none of this batch" in record.getMessage()


def test_the_rows_of_a_large_batch_are_shortened():
    rows = [f"train.jsonl:{i}" for i in range(10) for _ in range(2)]
    with pytest.raises(RewardError, match=r"prompt rows train.jsonl:0, train.jsonl:1, "):
        score([returning(None)], ["Q"] * 20, ["x"] * 20, {}, rows)
    with pytest.raises(RewardError, match=r"train.jsonl:2 and 7 more\."):
        score([returning(None)], ["Q"] * 20, ["x"] * 20, {}, rows)


def test_a_long_value_is_shortened_in_the_message():
    with pytest.raises(RewardError) as raised:
        score([returning("x" * 500)], ["Q"], ["x"], {}, ["a.jsonl:0"])
    assert "'xxxx" in str(raised.value) and "xxx..." in str(raised.value)
    assert "x" * 100 not in str(raised.value)


def test_on_error_is_raise_or_skip():
    with pytest.raises(ZooError, match=r"on_error='ignore'.*raise, skip"):
        score([exact_match], ["Q"], ["4"], {"answer": ["4"]}, ["a.jsonl:0"], "ignore")


# --- names and metrics -----------------------------------------------------------------------


def test_repeated_names_get_a_suffix():
    class Scorer:
        def __call__(self, prompts, completions, **columns):
            return [0.0] * len(completions)

    functions = [exact_match, exact_match, Scorer(), format_match("a"), format_match("b")]
    names = reward_names(functions)
    assert names == ["exact_match", "exact_match_2", "Scorer", "format_match", "format_match_2"]
    assert reward_names([exact_match, returning(1), exact_match]) == [
        "exact_match",
        "returns",
        "exact_match_2",
    ]


def test_metrics_are_each_functions_over_what_it_scored():
    nan = np.nan
    rewards = np.array([[1, 0.5, nan], [0, nan, nan], [1, nan, nan], [0, 1.5, 2]], np.float32)
    metrics = reward_metrics(rewards, ["exact_match", "exact_match", "only_one"])
    assert metrics.keys() == {
        "rewards/exact_match/mean",
        "rewards/exact_match/std",
        "rewards/exact_match_2/mean",
        "rewards/exact_match_2/std",
        "rewards/only_one/mean",
        "rewards/only_one/std",
    }
    assert all(type(value) is float for value in metrics.values())
    assert metrics["rewards/exact_match/mean"] == 0.5
    assert metrics["rewards/exact_match/std"] == pytest.approx(np.std([1, 0, 1, 0], ddof=1))
    assert metrics["rewards/exact_match_2/mean"] == 1.0
    assert metrics["rewards/exact_match_2/std"] == pytest.approx(math.sqrt(0.5))
    assert metrics["rewards/only_one/mean"] == 2.0
    assert math.isnan(metrics["rewards/only_one/std"])


def test_metrics_of_a_function_that_scored_nothing_are_nan():
    metrics = reward_metrics(np.full((4, 1), np.nan, np.float32), ["numeric_match"])
    assert math.isnan(metrics["rewards/numeric_match/mean"])
    assert math.isnan(metrics["rewards/numeric_match/std"])

"""The reward functions of reward fine-tuning, with TRL's `GRPOTrainer`'s contract, so that
functions written for it work here unchanged:

    fn(prompts, completions, **columns) -> list[float | None]

one value per completion, None where the function does not score it. `columns` holds the
prompt data set's other columns, one value per completion (`answer`, ...), with
`completion_lengths` (each completion's number of tokens) and `truncated` (whether it reached
the most tokens a completion may have).

- `resolve_reward`: what a user names (a callable, a built-in's name, or `module:function`) as
  a function;
- the built-ins: `exact_match`, `numeric_match`, `format_match(pattern)` and
  `length_penalty(max_completion_length, cache)` (DAPO's soft overlong punishment);
- `score`: every function called on a batch of completions, each value checked, as an array
  [N, F] (NaN: unscored), a bad value raised or skipped as a `RewardError` naming the function,
  the prompt's row and the value;
- `reward_metrics`: each function's mean and standard deviation over what it scored.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import math
import re
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from zoo.engine.errors import ZooError
from zoo.engine.posttraining.checks import choice

log = logging.getLogger("zoo")

RewardFunction = Callable[..., Sequence[Any]]
"""`fn(prompts, completions, **columns) -> list[float | None]`."""

FORMAT_PATTERN = r"\s*<think>.*?</think>\s*\S.*"
"""The built-in `format`'s pattern: a `<think>...</think>` block (its thoughts may be empty)
at the start, then an answer (at least one character that is not blank)."""
BUILTIN_REWARDS = ("exact_match", "numeric_match", "format", "length_penalty")
ON_ERROR = ("raise", "skip")
NUMBER = re.compile(r"(?:(?<!\w)-)?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
"""A number in text: an integer or a decimal, negative where a `-` that follows no letter or
digit comes first, with or without thousands separators (`1,234.5`)."""
MODULE_FUNCTION = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
FLOAT32_MAX = float(np.finfo(np.float32).max)
VALID = (
    "A reward function returns a list with one value per completion: a finite number (a "
    "float, int or bool) or None to leave that completion unscored."
)


class RewardError(ZooError):
    """A reward function raised or returned what is not one reward per completion."""


# --- the built-ins -------------------------------------------------------------------------


def exact_match(prompts: Sequence, completions: Sequence[str], **columns: Any) -> list[float]:
    """1.0 where the completion, stripped, is the `answer` column's value as text, stripped."""
    answers = _column(columns, "answer", "exact_match")
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answers, strict=True)]


def numeric_match(
    prompts: Sequence, completions: Sequence[str], **columns: Any
) -> list[float | None]:
    """1.0 where the completion's last number equals the `answer` column's (within a relative
    1e-6, or 1e-9 near 0), 0.0 where it differs or the completion has none, None where the
    answer is not a number."""
    answers = _column(columns, "answer", "numeric_match")
    return [_numbers_match(c, a) for c, a in zip(completions, answers, strict=True)]


def format_match(pattern: str, name: str = "format_match") -> RewardFunction:
    """A function (`name` its name) giving 1.0 where `pattern` matches the whole completion,
    `.` matching newlines too, else 0.0."""
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ZooError(
            f"format_match's pattern {pattern!r} is not a regular expression ({e}): give one "
            "in Python's `re` syntax that matches a whole well-formed completion."
        ) from None

    def matches(prompts: Sequence, completions: Sequence[str], **columns: Any) -> list[float]:
        return [float(compiled.fullmatch(c) is not None) for c in completions]

    return _named(matches, name)


def length_penalty(max_completion_length: int, cache: int) -> RewardFunction:
    """DAPO's soft overlong punishment, from the `completion_lengths` column: 0 for a
    completion of at most `max_completion_length - cache` tokens, falling linearly to -1 at
    `max_completion_length` tokens, -1 beyond (as TRL's `get_soft_overlong_punishment`)."""
    _check_lengths(max_completion_length, cache)
    free = max_completion_length - cache

    def penalty(prompts: Sequence, completions: Sequence[str], **columns: Any) -> list[float]:
        lengths = _column(columns, "completion_lengths", "length_penalty")
        return [
            0.0 if n <= free else (free - n) / cache if n <= max_completion_length else -1.0
            for n in lengths
        ]

    return _named(penalty, "length_penalty")


def _column(columns: Mapping[str, Sequence], key: str, name: str) -> Sequence:
    """The column `key` that the built-in `name` reads; a `ZooError` when the data lack it."""
    if key not in columns:
        raise ZooError(
            f"{name} reads the column '{key}', which the prompts do not have (their columns: "
            f"{', '.join(sorted(columns)) or 'none'}): give each prompt its '{key}'."
        )
    return columns[key]


def _numbers_match(completion: str, answer: object) -> float | None:
    """numeric_match's reward of one completion."""
    expected = _answer_number(answer)
    if expected is None:
        return None
    found = NUMBER.findall(completion)
    if not found:
        return 0.0
    return float(math.isclose(_parse(found[-1]), expected, rel_tol=1e-6, abs_tol=1e-9))


def _answer_number(answer: object) -> float | None:
    """The answer as a number: a finite int or float, or a text that is one number."""
    if isinstance(answer, int | float | np.integer | np.floating) and not isinstance(answer, bool):
        return float(answer) if math.isfinite(answer) else None
    text = str(answer).strip() if isinstance(answer, str) else ""
    return _parse(text) if NUMBER.fullmatch(text) else None


def _parse(text: str) -> float:
    return float(text.replace(",", ""))


def _check_lengths(max_completion_length: object, cache: object) -> None:
    """Refuse lengths that make no penalty: a whole max >= 1 and a whole cache in [0, max]."""
    whole = [not isinstance(v, bool) and isinstance(v, int) for v in (max_completion_length, cache)]
    if not all(whole) or not 0 <= cache <= max_completion_length or max_completion_length < 1:
        raise ZooError(
            f"length_penalty(max_completion_length={max_completion_length!r}, cache={cache!r}) "
            "needs whole numbers of tokens, max_completion_length >= 1 and cache in [0, "
            "max_completion_length]: the penalty falls from 0 to -1 over the last `cache` tokens "
            "a completion may have."
        )


def _named(fn: Callable, name: str) -> Callable:
    """`fn` under `name`, the name its metrics and messages use."""
    fn.__name__ = fn.__qualname__ = name
    return fn


# --- resolving what users name -------------------------------------------------------------


def resolve_reward(
    spec: str | RewardFunction,
    *,
    max_completion_length: int | None = None,
    length_cache: int | None = None,
) -> RewardFunction:
    """The reward function that `spec` names: a callable as it is; a bare name, a built-in's
    (`length_penalty` with the run's `max_completion_length` and `length_cache`); or
    `module:function`, the function imported from the module. A `ZooError` names a spec that is
    none of these, or whose module or function cannot be had, and says why."""
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise ZooError(
            f"{spec!r} is not a reward function: give a callable, a built-in's name "
            f"({', '.join(BUILTIN_REWARDS)}) or 'module:function'."
        )
    spec = spec.strip()
    if MODULE_FUNCTION.fullmatch(spec):
        return _imported(spec)
    if spec.isidentifier():
        return _builtin(spec, max_completion_length, length_cache)
    raise ZooError(
        f"Reward function '{spec}' is neither a built-in's name nor 'module:function': name a "
        f"built-in ({', '.join(BUILTIN_REWARDS)}) or a function importable from a module, as "
        "my_rewards:correctness or my_package.rewards:correctness."
    )


def _builtin(name: str, max_completion_length: int | None, cache: int | None) -> RewardFunction:
    """The built-in reward function `name`."""
    if name == "length_penalty":
        if max_completion_length is None or cache is None:
            raise ZooError(
                "The reward length_penalty needs the run's max_completion_length and the "
                "length of its penalty's ramp (the cache, in tokens): give both."
            )
        return length_penalty(max_completion_length, cache)
    builtins = {
        "exact_match": exact_match,
        "numeric_match": numeric_match,
        "format": format_match(FORMAT_PATTERN, "format"),
    }
    if name not in builtins:
        raise ZooError(
            f"There is no built-in reward function '{name}': the built-ins are "
            f"{', '.join(BUILTIN_REWARDS)}; name your own as 'module:function'."
        )
    return builtins[name]


def _imported(spec: str) -> RewardFunction:
    """The function of a `module:function` spec."""
    module_name, attribute = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001  (whatever stops the import: name it)
        raise ZooError(
            f"Cannot import module '{module_name}' of reward function '{spec}': "
            f"{type(e).__name__}: {e}. Name a module importable from the current directory, "
            "PYTHONPATH or the installed packages."
        ) from None
    if not hasattr(module, attribute):
        close = difflib.get_close_matches(attribute, [n for n in dir(module) if n[0] != "_"], 3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ZooError(
            f"Module '{module_name}' has no '{attribute}'{hint}, which reward function "
            f"'{spec}' names: name a function that the module defines."
        )
    fn = getattr(module, attribute)
    if not callable(fn):
        raise ZooError(
            f"'{spec}' is {_short(fn)} (of type {type(fn).__name__}), not a function: a reward "
            "function is called as fn(prompts, completions, **columns)."
        )
    return fn


# --- calling them, checked ------------------------------------------------------------------


def reward_names(functions: Sequence[RewardFunction]) -> list[str]:
    """Each function's name (its `__name__`, or its type's), made unique as `unique_names`
    does: the names of its metrics and messages."""
    return unique_names([getattr(fn, "__name__", type(fn).__name__) for fn in functions])


def unique_names(names: Sequence[str]) -> list[str]:
    """`names` with a repeated one suffixed (`_2`, `_3`, ...), so that no two are the same."""
    unique: list[str] = []
    for base in names:
        name, n = base, 1
        while name in unique:
            n += 1
            name = f"{base}_{n}"
        unique.append(name)
    return unique


def score(
    functions: Sequence[RewardFunction],
    prompts: Sequence,
    completions: Sequence[str],
    columns: Mapping[str, Sequence],
    rows: Sequence[str],
    on_error: str = "raise",
) -> np.ndarray:
    """The rewards [N, F] float32 of N completions by F functions, NaN where a function gave
    None. `rows` names each completion's prompt (`train.jsonl:12`) for messages. A function
    that raises or returns what is not one finite number or None per completion is a
    `RewardError`: raised (`on_error="raise"`), or logged as a warning with its column left
    unscored for this batch (`"skip"`)."""
    choice("on_error", on_error, ON_ERROR, "a way to handle a bad reward")
    rewards = np.full((len(completions), len(functions)), np.nan, np.float32)
    for j, (fn, name) in enumerate(zip(functions, reward_names(functions), strict=True)):
        try:
            rewards[:, j] = _call(fn, name, prompts, completions, columns, rows)
        except RewardError as e:
            if on_error == "raise":
                raise
            log.warning("%s With on_error=skip, '%s' scores none of this batch.", e, name)
    return rewards


def _call(
    fn: RewardFunction,
    name: str,
    prompts: Sequence,
    completions: Sequence[str],
    columns: Mapping[str, Sequence],
    rows: Sequence[str],
) -> np.ndarray:
    """`fn`'s rewards [N] of the completions, checked."""
    try:
        values = fn(prompts, completions, **columns)
    except ZooError as e:  # the function's own message says what is wrong and what would do
        raise RewardError(
            f"Reward function '{name}' cannot score the completions of {_rows(rows)}: {e}"
        ) from e
    except Exception as e:
        raise RewardError(
            f"Reward function '{name}' raised {type(e).__name__}: {e} ({_where(e)}) on the "
            f"completions of {_rows(rows)}. A reward function must not raise: it returns None "
            "for a completion it cannot score."
        ) from e
    if isinstance(values, str | bytes) or not (
        isinstance(values, Sequence) or (isinstance(values, np.ndarray) and values.ndim == 1)
    ):
        raise RewardError(
            f"Reward function '{name}' returned {_short(values)} (of type "
            f"{type(values).__name__}), "
            f"not a list, for the completions of {_rows(rows)}. {VALID}"
        )
    if len(values) != len(completions):
        raise RewardError(
            f"Reward function '{name}' returned {len(values)} values for {len(completions)} "
            f"completions (of {_rows(rows)}): {_short(values)}. {VALID}"
        )
    for i, value in enumerate(values):
        _check_value(name, value, i, rows[i])
    return np.array([np.nan if v is None else float(v) for v in values], np.float32)


def _check_value(name: str, value: object, index: int, row: str) -> None:
    """Refuse a value that is neither None nor a number finite in float32."""
    numeric = isinstance(value, int | float | np.integer | np.floating | np.bool_)
    if value is None or (numeric and _finite32(value)):
        return
    what = "not finite in float32" if numeric else f"a {type(value).__name__}, not a number"
    raise RewardError(
        f"Reward function '{name}' returned {_short(value)} ({what}) for completion {index} "
        f"(of prompt row {row}). {VALID}"
    )


def _finite32(value: float | np.number | np.bool_) -> bool:
    try:
        return abs(float(value)) <= FLOAT32_MAX  # False for NaN too
    except OverflowError:  # an int too large for a float
        return False


def _where(error: Exception) -> str:
    """Where `error` was raised: file, line and function of its innermost frame."""
    frame = traceback.extract_tb(error.__traceback__)[-1]
    return f"at {frame.filename}:{frame.lineno} in {frame.name}"


def _rows(rows: Sequence[str], shown: int = 3) -> str:
    """The distinct prompt rows of a batch, the first few named."""
    distinct = list(dict.fromkeys(rows))
    named = ", ".join(distinct[:shown])
    more = len(distinct) - shown
    return f"prompt row{'s' * (len(distinct) > 1)} {named}" + (f" and {more} more" * (more > 0))


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


# --- metrics ---------------------------------------------------------------------------------


def reward_metrics(rewards: np.ndarray, names: Sequence[str]) -> dict[str, float]:
    """Each function's mean and Bessel-corrected standard deviation over the completions it
    scored, as `rewards/<name>/mean` and `rewards/<name>/std` (NaN: none scored; the std: fewer
    than two), a repeated name suffixed as `unique_names` does."""
    metrics = {}
    for name, column in zip(unique_names(names), np.asarray(rewards, np.float64).T, strict=True):
        scored = column[~np.isnan(column)]
        metrics[f"rewards/{name}/mean"] = float(scored.mean()) if scored.size else math.nan
        metrics[f"rewards/{name}/std"] = float(scored.std(ddof=1)) if scored.size > 1 else math.nan
    return metrics

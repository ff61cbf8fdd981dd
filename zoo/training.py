"""Training from Python as the command line trains: `zoo.fit(model, *overrides)` is
`python -m zoo.train` (the command, `zoo/train.py`), `zoo.run(cfg)` trains a composed config;
both print the command's console lines and return the trained model (`RunResult`).

Everything goes through the one trainer (`zoo.engine.loop.Trainer`), so a run started here is
the one the command would run, with the same workdir, checkpoints and `train.log`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

from omegaconf import DictConfig

from zoo.engine.loop import RunLog, RunResult, Trainer
from zoo.engine.report import ConsoleHandler
from zoo.lm_evaluation import lm_eval_callbacks
from zoo.overrides import compose


def fit(model: str, *overrides: str, callbacks: Sequence[Any] = ()) -> RunResult:
    """Run the CLI's job from Python: `fit("cnn", "data=digits", "trainer.steps=200")` is
    `python -m zoo.train model=cnn data=digits trainer.steps=200`, returning the trained model,
    its final eval metrics and its workdir. It prints what the CLI prints and writes what the
    CLI writes (`train.log`, `.hydra/`). `callbacks`: see "Callbacks" in the README; the
    `lm_eval` section's (`lm_eval.tasks=[...]`) runs after them."""
    args = [f"model={model}", *overrides]
    with console_logging(), RunLog() as run_log:
        cfg = compose(args)
        trainer = Trainer(cfg, callbacks=[*callbacks, *lm_eval_callbacks(cfg)])
        return trainer.fit(overrides=args, run_log=run_log)


def run(cfg: DictConfig) -> RunResult:
    """Train a composed config (`zoo.compose([...])`) as the CLI does, printing its lines."""
    with console_logging(), RunLog() as run_log:
        return Trainer(cfg, callbacks=lm_eval_callbacks(cfg)).fit(run_log=run_log)


@contextlib.contextmanager
def console_logging() -> Iterator[None]:
    """The CLI's console lines (progress, evals, warnings) for a run started from Python, and
    in its `train.log`: zoo's logger at INFO while the run lasts, shown by the CLI's console
    handler unless the program has set up logging of its own (a root handler other than the
    bare one `logging.basicConfig()` makes, which absl installs on import)."""
    zoo_log, root = logging.getLogger("zoo"), logging.getLogger()
    level = zoo_log.level
    if zoo_log.getEffectiveLevel() > logging.INFO:
        zoo_log.setLevel(logging.INFO)
    bare = list(root.handlers)
    ours = all(_is_bare(handler) for handler in bare)
    console = ConsoleHandler()
    console.setFormatter(logging.Formatter("%(message)s"))
    if ours:
        for handler in bare:
            root.removeHandler(handler)
        root.addHandler(console)
    try:
        yield
    finally:
        zoo_log.setLevel(level)
        if ours:
            root.removeHandler(console)
            for handler in bare:
                root.addHandler(handler)


def _is_bare(handler: logging.Handler) -> bool:
    """A handler as `logging.basicConfig()` makes it: stderr, the default format."""
    formatter = handler.formatter
    return (
        type(handler) is logging.StreamHandler
        and formatter is not None
        and formatter._fmt == logging.BASIC_FORMAT
    )

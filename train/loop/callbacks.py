"""Callbacks of the Python API (`zoo.fit(..., callbacks=[...])`): objects with any of the hooks
`on_train_window(step, metrics)`, `on_eval(step, metrics)`, `on_checkpoint(step, path)` and
`on_end(result)`.

Every hook runs as the caller's code outside the run does, without the run's mesh current
(`zoo.engine.sharding.deactivated`): what it loads or computes (a checkpoint on one device) is
placed on a mesh of its own. It gets host values the loop already has: a training window's
means when the loop fetches them (a window late, so the host never waits on the device for a
callback), an eval's metrics after the eval, a checkpoint once it is complete on disk (saves
are asynchronous: when the next save starts or the run ends). A hook that returns `STOP` asks the run to stop: it
saves a checkpoint and raises `CallbackStop`, and running it again resumes, as after a SIGTERM.
A hook that raises stops the run the same way with `CallbackFailed`, the callback's own
exception chained to it (its traceback shows where the callback failed).

`on_end` gets the `RunResult` of each call that returns one: a run that trained to
`trainer.steps`, one that stopped early (`trainer.early_stop`), one that found the run already
complete. A call that ends in an exception (`CallbackStop`, `CallbackFailed` of an earlier hook,
`Interrupted` on a signal, any error) does not call it; the stop exceptions carry the step and
checkpoint instead. An `on_end` that raises ends the call with `CallbackFailed` after it.

Each window, eval and checkpoint reaches the callbacks once across kills and resumes: a resumed
run replays the steps after its checkpoint, with the same values, and would deliver their
windows again, so the run keeps a record of the last step delivered per hook in
`<workdir>/callbacks.json` (rewritten atomically after each delivery, by each process of its
own) and skips what that record holds. The one repeat left: a kill while a hook runs, or
between its return and the record's rewrite (a file replace, well under a millisecond),
delivers that one event again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from zoo.engine import sharding
from zoo.engine.loop.rundir import replace_file

STOP = "stop"
"""What a hook returns to ask the run to stop (saved and resumable)."""

HOOKS = ("on_train_window", "on_eval", "on_checkpoint", "on_end")
STEPPED = ("on_train_window", "on_eval", "on_checkpoint")
"""The hooks whose first argument is a step: delivered once per step across resumes
(`on_end` comes once per call that returns a result, never recorded)."""
RECORD = "callbacks.json"


class CallbackStop(Exception):
    """A callback asked the run to stop; it saved a checkpoint at `step`."""

    def __init__(self, hook: str, step: int, checkpoint: str):
        self.hook, self.step, self.checkpoint = hook, step, checkpoint
        super().__init__(
            f"Stopped at the request of {hook} after step {step}; saved {checkpoint}. Run it "
            "again with the same workdir to resume."
        )


class CallbackFailed(Exception):
    """A callback raised; the run stopped (with a checkpoint at `step` when there was one to
    save). The callback's exception is this one's `__cause__`."""

    def __init__(self, hook: str, error: BaseException, step: int, checkpoint: str | None):
        self.hook, self.step, self.checkpoint = hook, step, checkpoint
        saved = f"saved {checkpoint}" if checkpoint else "nothing more to save"
        super().__init__(
            f"{hook} raised {type(error).__name__}: {error} (step {step}). The run stopped; "
            f"{saved}. The callback's traceback is above."
        )


class Callbacks:
    """The run's callbacks, called in order; remembers the first stop request and the first
    failure (after a failure no hook is called again)."""

    def __init__(self, callbacks: Iterable[Any] = ()):
        self._callbacks = list(callbacks)
        self.stop_by: str | None = None
        self.failure: tuple[str, BaseException] | None = None
        self._record: str | None = None
        self._delivered: dict[str, int] = {}

    def record_in(self, workdir: str, process: int = 0) -> None:
        """Deliver each step's events once across this run's processes: read what the earlier
        ones delivered from the workdir's record, and keep it there (only with callbacks)."""
        if not self._callbacks:
            return
        name = RECORD if process == 0 else f"callbacks.{process}.json"
        self._record = os.path.join(workdir, name)
        if os.path.exists(self._record):
            with open(self._record, encoding="utf-8") as f:
                self._delivered = {hook: int(step) for hook, step in json.load(f).items()}

    def __call__(self, hook: str, *args: Any) -> None:
        stepped = hook in STEPPED
        if stepped and args[0] <= self._delivered.get(hook, -1):
            return  # delivered before a kill, and replayed since with the same values
        self._deliver(hook, *args)
        if stepped and self._record is not None and self.failure is None:
            self._delivered[hook] = int(args[0])
            replace_file(self._record, json.dumps(self._delivered))

    def _deliver(self, hook: str, *args: Any) -> None:
        for callback in self._callbacks:
            method = getattr(callback, hook, None)
            if method is None or self.failure is not None:
                continue
            name = f"{type(callback).__name__}.{hook}"
            try:
                with sharding.deactivated():  # as outside the run: the loop's mesh is current
                    answer = method(*args)
            except Exception as error:  # noqa: BLE001  (any failure of user code stops the run)
                self.failure = (name, error)
                continue
            if answer == STOP and self.stop_by is None:
                self.stop_by = name

    @property
    def halting(self) -> bool:
        return self.stop_by is not None or self.failure is not None

    def halt(self, step: int, checkpoint: str | None) -> Exception:
        """The exception that ends the run after a stop request or a failure."""
        if self.failure is not None:
            hook, error = self.failure
            failed = CallbackFailed(hook, error, step, checkpoint)
            failed.__cause__ = error
            return failed
        return CallbackStop(self.stop_by or "", step, checkpoint or "")

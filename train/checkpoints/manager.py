"""Orbax checkpoints of everything a run's future depends on, one directory per saved step.

A checkpoint `<workdir>/checkpoints/<step>/` holds five items:
- `state`: the model and optimizer state (params, BatchNorm statistics, module-bound RngState,
  optimizer moments and update count), as one `nnx.State`;
- `window`: the training metrics summed so far in the current, not yet logged, log window, so a
  resumed run logs exactly the numbers an uninterrupted one would;
- `data`: the Grain iterator's position;
- `meta` (JSON): the step, the base PRNG key, where the log window started, the last eval, the
  run's XLA compilations so far (so `xla/compile_*` continue after a resume), and a checksum of every array of `state` and `window` (`zoo.engine.checkpoints.checksums`), verified at restore;
- `config` (JSON): the resolved config. Nothing is ever pickled or eval'ed.

Saves are asynchronous: the blocking part copies device arrays to host, the write to disk
overlaps with training, and `close()` waits for it. Orbax writes into `<step>.orbax-checkpoint-
tmp-*` and renames it when complete, so a save killed midway never looks like a checkpoint; the
leftover is deleted when the next run opens the directory. A save that fails (permission, full
disk, I/O error), at once or in the background, stops the run with `SaveFailed`: one line with
the cause, the directory and the last complete checkpoint. `poll()` looks for a background
failure, at most once a second.

Retention: the latest `keep` checkpoints, plus (with `best_metric`) the best one by that eval
metric among the checkpoints saved with an eval. The latest is never deleted (DESIGN.md §8).
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from zoo.engine.checkpoints import checksums
from zoo.engine.checkpoints.failures import cause, quiet_storage_noise
from zoo.engine.checkpoints.reader import saved_steps, verify
from zoo.engine.errors import SaveFailed

if TYPE_CHECKING:  # Orbax and Grain only once a checkpoint is opened
    import grain

FORMAT = 2
"""Version of the checkpoint layout above; 1 is the same without checksums. A checkpoint with
another version is refused."""
FORMATS = (1, 2)

POLL_SECONDS = 1.0
"""How often, at most, `poll()` asks whether a background save failed."""

_details = logging.getLogger("train.checkpoint")  # train.log only, not the console

UNREADABLE_SUFFIX = ".unreadable"
"""A checkpoint that cannot be read is renamed `<step>.unreadable` (kept, never deleted), so the
run that falls back to an earlier step can write that step again."""


class Checkpointer:
    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
    ):
        import orbax.checkpoint as ocp
        from orbax.checkpoint import checkpoint_managers as policies
        from zoo.engine.checkpoints.handlers import StateHandler

        self.directory = os.path.abspath(directory)
        preserve: list[Any] = [policies.LatestN(n=keep)]  # None: keep all
        if best_metric:
            worst = math.inf if best_mode == "min" else -math.inf

            def metric(metrics: Mapping[str, Any]) -> float:
                value = float(metrics.get(best_metric, worst))
                return worst if math.isnan(value) else value

            preserve.append(
                policies.BestN(
                    get_metric_fn=metric,
                    reverse=best_mode == "min",  # sorted best-last: descending for a loss
                    n=1,
                    keep_checkpoints_without_metrics=False,
                )
            )
        quiet_storage_noise()
        _check_writable(self.directory)
        handlers = ocp.handlers.DefaultCheckpointHandlerRegistry()
        for item in ("state", "window"):
            handler = StateHandler()
            handlers.add(item, ocp.args.StandardSave, handler)
            handlers.add(item, ocp.args.StandardRestore, handler)
        self._manager = ocp.CheckpointManager(
            self.directory,
            handler_registry=handlers,
            options=ocp.CheckpointManagerOptions(
                create=True,
                enable_async_checkpointing=True,
                # Directories made while `save` blocks: a directory that cannot be made fails
                # there, instead of leaving the background writers waiting minutes for it.
                async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
                cleanup_tmp_directories=True,
                preservation_policy=policies.AnyPreservationPolicy(preserve),
            ),
        )
        self._polled = time.monotonic()
        self._saving: int | None = None  # the step of the save that may still be writing
        self._broken = False  # a save failed: its threads are not waited for

    def save(
        self,
        step: int,
        state: Any,
        data_iterator: grain.DatasetIterator,
        config: Mapping[str, Any],
        *,
        window: Any = None,
        meta: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> None:
        """Start saving `step`; returns once the arrays are copied off the device.

        `metrics` (an eval's) rank the checkpoint for `best_metric`; without them it is kept
        only while it is among the latest `keep`."""
        import grain
        import orbax.checkpoint as ocp

        arrays = {**checksums.flat(state, "state"), **checksums.flat(window or {}, "window")}
        meta = {"format": FORMAT, "step": step, **dict(meta or {})}
        meta["checksums"] = checksums.checksums(arrays)
        items: dict[str, Any] = {
            "state": ocp.args.StandardSave(state),
            "data": grain.checkpoint.CheckpointSave(data_iterator),
            "config": ocp.args.JsonSave(dict(config)),
            "meta": ocp.args.JsonSave(meta),
        }
        if window is not None:
            items["window"] = ocp.args.StandardSave(window)
        try:  # a failure of the previous save surfaces here too
            self._manager.save(
                step, args=ocp.args.Composite(**items), metrics=dict(metrics) if metrics else None
            )
        except Exception as e:  # noqa: BLE001  (any failure to write: stop, naming it)
            raise self._failed(self._saving or step, e) from None
        self._saving = step

    def poll(self) -> None:
        """Raise `SaveFailed` if a save running in the background has failed (asks at most once
        every `POLL_SECONDS`)."""
        now = time.monotonic()
        if self._saving is None or now - self._polled < POLL_SECONDS:
            return
        self._polled = now
        try:
            self._manager.check_for_errors()
        except Exception as e:  # noqa: BLE001
            raise self._failed(self._saving, e) from None

    def _failed(self, step: int, error: BaseException) -> SaveFailed:
        _details.info("Saving checkpoint %d failed", step, exc_info=error)
        self._broken = True
        good = saved_steps(self.directory)
        if step in good:  # saved; what failed was removing an older one
            return SaveFailed(
                f"Checkpoint {step} was saved, but removing an older checkpoint from "
                f"{self.directory} (trainer.keep) failed: {cause(error)}. The run stopped; "
                f"the latest checkpoints, step {step} among them, are intact. Fix the "
                "permissions (or move the old checkpoint away) and run the same command again "
                "to resume."
            )
        safe = (
            f"the last complete checkpoint is step {good[-1]} ({self.step_path(good[-1])})"
            if good
            else "no checkpoint of this run is complete"
        )
        return SaveFailed(
            f"Saving checkpoint {step} into {self.directory} failed: {cause(error)}. The run "
            f"stopped; {safe}. Fix the cause (space, permissions) and run the same command "
            "again to resume from there."
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def step_path(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def restore(
        self,
        step: int,
        abstract_state: Any,
        data_iterator: grain.DatasetIterator | None = None,
        abstract_window: Any = None,
    ) -> dict[str, Any]:
        """Everything saved at `step`: `state` (and `window`) placed with the shardings their
        abstract targets carry, `meta`, `config`, and the iterator set to the saved position."""
        import grain
        import orbax.checkpoint as ocp

        items: dict[str, Any] = {
            "state": ocp.args.StandardRestore(abstract_state),
            "meta": ocp.args.JsonRestore(),
            "config": ocp.args.JsonRestore(),
        }
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
        if abstract_window is not None:
            items["window"] = ocp.args.StandardRestore(abstract_window)
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        if restored["meta"].get("format") in FORMATS:
            arrays = checksums.flat(restored["state"], "state")
            arrays.update(checksums.flat(restored.get("window") or {}, "window"))
            verify(self.step_path(step), arrays)
        return {name: restored[name] for name in items}

    def restore_state(self, step: int, abstract_state: Any) -> Any:
        """The state saved at `step`, placed with the shardings that `abstract_state` carries."""
        return self.restore(step, abstract_state)["state"]

    def restore_config(self, step: int) -> dict[str, Any]:
        import orbax.checkpoint as ocp

        restored = self._manager.restore(
            step, args=ocp.args.Composite(config=ocp.args.JsonRestore())
        )
        return restored["config"]

    def set_aside(self, step: int) -> str:
        """Rename an unreadable checkpoint to `<step>.unreadable` (kept for inspection) so that
        the step can be saved again; returns the new path."""
        target = self.step_path(step) + UNREADABLE_SUFFIX
        n = 1
        while os.path.exists(target):
            n += 1
            target = f"{self.step_path(step)}{UNREADABLE_SUFFIX}.{n}"
        os.rename(self.step_path(step), target)
        self._manager.reload()
        return target

    def wait(self) -> None:
        """Block until every save started so far is on disk; `SaveFailed` if one failed."""
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._failed(self._saving or 0, e) from None

    def close(self) -> None:
        """Wait for the last save and let go of the directory; once (later calls do nothing).
        After a failed save there is nothing left to wait for."""
        if self._manager is None or self._broken:
            self._manager = None  # a failed save's threads are not joined: the process exits
            return
        self.wait()
        self._manager, manager = None, self._manager
        manager.close()


def _check_writable(directory: str) -> None:
    """Make (or find) `directory` and a directory in it, as each save will: a run that could
    never save stops before it trains."""
    try:
        os.makedirs(directory, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".zoo-write-check-", dir=directory))
    except OSError as e:
        raise SaveFailed(
            f"Cannot write checkpoints into {directory}: {cause(e)}. Nothing was trained; give "
            "the run a workdir it can write (or fix the permissions) and run it again."
        ) from None

"""SIGTERM and SIGINT during training: finish the step, checkpoint, flush the logs, then exit.

The first signal only sets a flag that the loop reads after each step. A second one (a second
Ctrl-C, or a scheduler that lost patience) exits at once, like `kill -9`: the run then resumes
from its last complete checkpoint.

In a multi-process job every process must save the same step, whichever process was signalled.
There SIGTERM is left to JAX's preemption service, which hears it in any process and agrees with
all of them on the next step they can all reach (`reached_preemption_sync_point`); a SIGINT is
passed on to it as a SIGTERM of the same process. Every process then saves that step and exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

import jax
from jax.experimental import multihost_utils

HANDLED = (signal.SIGTERM, signal.SIGINT)


class Interrupted(Exception):
    """Training stopped early on a signal, after saving a checkpoint at `step`."""

    def __init__(self, signum: int, step: int, checkpoint: str):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.exit_code = 128 + signum  # the shell's convention: 143 for SIGTERM, 130 for SIGINT
        super().__init__(
            f"Stopped by {signal.Signals(signum).name} after step {step}; saved {checkpoint}. "
            "Run the same command again to resume."
        )


class StopRequests:
    """The first SIGTERM/SIGINT received while `installed()` is active, if any; in a
    multi-process job, the stop that all processes agreed on."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._shared = jax.process_count() > 1

    def due(self, dispatch: int) -> int | None:
        """The signal to stop for after dispatch number `dispatch` (the same on every process:
        ask after every dispatch), or None."""
        if (
            self._shared
            and self.signum is None
            and multihost_utils.reached_preemption_sync_point(dispatch)
        ):
            self.signum = signal.SIGTERM
        return self.signum

    def _pass_on(self, signum: int, frame) -> None:
        os.write(
            2, f"\n{signal.Signals(signum).name}: stopping every process of the job.\n".encode()
        )
        os.kill(os.getpid(), signal.SIGTERM)  # JAX's preemption service hears it

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            os.write(2, f"\n{name} again: exiting at once.\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        # Straight to stderr: a signal handler must not take the logging locks.
        os.write(
            2,
            f"\n{name}: finishing this step, then saving a checkpoint; send it again to exit "
            "at once.\n".encode(),
        )

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequests]:
        """Handle the signals inside the block (main thread only; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        if self._shared:
            previous = {signal.SIGINT: signal.signal(signal.SIGINT, self._pass_on)}
        else:
            previous = {sig: signal.signal(sig, self._handle) for sig in HANDLED}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

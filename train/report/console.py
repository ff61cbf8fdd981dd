"""The console: zoo's own log lines and real warnings, printed above a live progress bar.

Log records and the progress bar share one rich `Console`, so a line logged while the bar is
showing lands above it instead of tearing it.
"""

from __future__ import annotations

import logging

from rich.console import Console

CONSOLE = Console(stderr=True, highlight=False, soft_wrap=True)


class ConsoleHandler(logging.Handler):
    """Shows INFO lines from zoo's own loggers and WARNING or worse from any other logger but
    the storage stack's.

    asyncio and absl (the checkpoint library's logger) speak of the storage stack's internals:
    after a checkpoint that could not be read or written, every read or write still in flight
    fails in turn, and each is reported with a traceback. zoo has already named the checkpoint,
    the cause and what it does instead; those lines go to train.log only (absl's CRITICAL ones
    excepted)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "asyncio" or (
            record.name == "absl" and record.levelno < logging.CRITICAL
        ):
            return False
        own = record.name == "zoo" or record.name.startswith("zoo.")
        return (own and record.levelno >= logging.INFO) or record.levelno >= logging.WARNING

    def emit(self, record: logging.LogRecord) -> None:
        try:
            CONSOLE.print(self.format(record), markup=False)
        except Exception:  # noqa: BLE001  (logging's contract: report, never raise)
            self.handleError(record)

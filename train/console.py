"""The console: zoo's own log lines and real warnings, printed above a live progress bar.

Log records and the progress bar share one rich `Console`, so a line logged while the bar is
showing lands above it instead of tearing it.
"""

from __future__ import annotations

import logging

from rich.console import Console

CONSOLE = Console(stderr=True, highlight=False, soft_wrap=True)


class ConsoleHandler(logging.Handler):
    """Shows INFO lines from zoo's own loggers and WARNING or worse from any logger but asyncio.

    asyncio speaks only of the checkpoint library's internal tasks: after a checkpoint that
    could not be read, the reads still in flight fail when its event loop closes, and asyncio
    reports each as "Task exception was never retrieved" with a traceback. zoo has already named
    the checkpoint and what it does instead; those lines go to train.log only."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "asyncio":
            return False
        own = record.name == "zoo" or record.name.startswith("zoo.")
        return (own and record.levelno >= logging.INFO) or record.levelno >= logging.WARNING

    def emit(self, record: logging.LogRecord) -> None:
        try:
            CONSOLE.print(self.format(record), markup=False)
        except Exception:  # noqa: BLE001  (logging's contract: report, never raise)
            self.handleError(record)

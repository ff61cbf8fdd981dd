"""Reporting: TensorBoard event files and the console (`reporter`, `event_files`, `console`),
what a run announces about itself (`announce`, `summaries`, `devices`), and what it observes
while it trains (`observe`, `memory`)."""

from zoo.engine.report.console import CONSOLE, ConsoleHandler
from zoo.engine.report.reporter import EvalReport, ReplyPrompt, image_grid

__all__ = [
    "CONSOLE",
    "ConsoleHandler",
    "EvalReport",
    "ReplyPrompt",
    "image_grid",
]

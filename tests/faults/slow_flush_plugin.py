"""Loaded through ZOO_PLUGINS: events reach the disk only when the run flushes them. The event
writer's own timer fires once an hour instead of every few seconds, and its file buffers 64 MiB
instead of 8 KiB (a full buffer would otherwise write the events before it as a side effect)."""

import tensorboardX.record_writer
from zoo.engine.report import reporter as report

report.FLUSH_SECS = 3600


def _open_with_a_large_buffer(path):
    return open(path, "wb", buffering=64 << 20)  # tensorboardX closes it


tensorboardX.record_writer.open_file = _open_with_a_large_buffer

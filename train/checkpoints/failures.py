"""The storage stack's failures in one line each, and its aftershocks kept off the console.

A failed read or write in Orbax and TensorStore surfaces as a long exception text (the OCDBT
key, both paths, an `os_error_code`), and leaves behind reads and writes still in flight on an
event loop that has closed: each of those reports itself as `RuntimeError: Event loop is
closed`, an un-awaited coroutine, or a coroutine that Python could not finalise at exit, a
screenful of tracebacks that say nothing new. On a full disk TensorBoard's writing thread dies
with a traceback too. zoo names the checkpoint (or the events) and what it does instead; the
rest goes to train.log only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
import threading
import types

_note = logging.getLogger("train.checkpoint").info
_OS_ERROR = re.compile(r"os_error_code='?(\d+)")
_NOISE = re.compile(r"<bound method [^>]*>|<[\w.]+ object at 0x[0-9a-f]+>")


def reason(error: BaseException, limit: int = 200) -> str:
    """`Type: message` on one line, without object reprs, cut at `limit` characters."""
    text = " ".join(_NOISE.sub("...", str(error)).split())
    if len(text) > limit:
        text = text[:limit] + " ..."
    return f"{type(error).__name__}: {text}"


def cause(error: BaseException) -> str:
    """What went wrong with the file system, as the OS says it ('No space left on device'),
    else `reason(error)`."""
    if isinstance(error, OSError) and error.errno is not None:
        where = f" ({error.filename})" if error.filename else ""
        return f"{os.strerror(error.errno)}{where}"
    found = _OS_ERROR.search(str(error))
    if found:
        return os.strerror(int(found.group(1)))
    return reason(error)


def quiet_storage_noise() -> None:
    """Route the aftershocks of a failed read or write to train.log (once per process; every
    other exception is shown as before)."""
    if getattr(sys.unraisablehook, "_zoo_quiet", False):
        return
    show_unraisable, show_exception = sys.unraisablehook, sys.excepthook

    def unraisable_hook(unraisable) -> None:
        if _aftershock(unraisable.exc_value, unraisable.object):
            _quietly(f"after a failed read or write: {unraisable.exc_value!r}")
        else:
            show_unraisable(unraisable)

    def exception_hook(kind, value, traceback) -> None:
        if _aftershock(value, None):
            _quietly(f"after a failed read or write: {value!r}")
        else:
            show_exception(kind, value, traceback)

    def thread_hook(args) -> None:
        if _aftershock(args.exc_value, None) or _event_writer(args.thread, args.exc_value):
            _quietly(f"in thread {args.thread.name}: {args.exc_value!r}")
        else:
            show_thread(args)

    show_thread = threading.excepthook
    unraisable_hook._zoo_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook, sys.excepthook = unraisable_hook, exception_hook
    threading.excepthook = thread_hook


def _aftershock(error: BaseException | None, where: object) -> bool:
    if isinstance(error, RuntimeError) and "Event loop is closed" in str(error):
        return True
    return isinstance(where, types.CoroutineType | asyncio.Future)


def _event_writer(thread: object, error: BaseException | None) -> bool:
    """TensorBoard's writing thread failing to write (a full disk): the run says so itself."""
    return type(thread).__module__.startswith("tensorboardX") and isinstance(error, OSError)


def _quietly(line: str) -> None:
    try:
        _note("%s", line)
    except Exception:  # noqa: BLE001, S110  (at interpreter exit logging may be gone: drop the line)
        pass

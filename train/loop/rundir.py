"""A run's directory: held by one run at a time, written only once the run is known good.

`hold(workdir)` creates the directory if needed and takes an exclusive OS lock on
`<workdir>/.zoo.lock` (`.zoo.lock.<process>` for the other processes of a multi-process job),
recording the holder's pid, host and start time in it. Before anything is written, it checks that
the run could write everything it writes there (`check_writable`), so that a workdir an earlier
run left (or one made read-only to keep it) is refused in one line rather than half-written by a
run that then fails at its first event file. The lock is `flock`: the kernel drops it
when the process ends, however it ends, so a run killed with SIGKILL leaves no stale lock. A
second run on the same workdir stops at once, naming the first. Reading a workdir (`zoo.load`,
fine-tuning from it) takes no lock. Holding is reentrant within a process: the command line
takes the lock before it writes anything, and the trainer it starts takes it again.

`record(...)` then writes the run's composed config (`.hydra/config.yaml`) and command-line
overrides (`.hydra/overrides.yaml`), and a `RunLog` appends every log line of the run to
`<workdir>/train.log`, those logged before the run was known good included.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import logging.handlers
import os
import socket
from collections.abc import Iterator, Sequence
from typing import Any, Self

from omegaconf import DictConfig, OmegaConf
from zoo.engine.errors import ZooError

LOCK = ".zoo.lock"
LOG = "train.log"
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] %(message)s"
# What a run writes into an existing workdir besides the new files it adds to the directory
# itself (event files, its lock, the callbacks' record): the directories it adds files to and the
# files it opens for writing.
WRITTEN_DIRECTORIES = (".hydra", "checkpoints")
TOKENIZER = "tokenizer.json"
WRITTEN_FILES = (LOG, TOKENIZER)

_held: dict[str, list[int]] = {}  # lock path -> [file descriptor, holds]


def lock_path(workdir: str, process: int = 0) -> str:
    return os.path.join(workdir, LOCK if process == 0 else f"{LOCK}.{process}")


@contextlib.contextmanager
def hold(workdir: str, process: int = 0) -> Iterator[None]:
    """The workdir, checked writable, created if needed and locked for this run while the
    block runs."""
    path = lock_path(os.path.abspath(workdir), process)
    if path in _held:
        _held[path][1] += 1
        try:
            yield
        finally:
            _held[path][1] -= 1
        return
    fd = _open_lock(workdir, path, process)
    _held[path] = [fd, 1]
    try:
        yield
    finally:
        del _held[path]
        os.close(fd)  # releases the lock


def check_usable(workdir: str, process: int = 0) -> None:
    """Refuse, without writing anything, a workdir that this run could not write or that
    another run holds (the lock itself is taken by `hold`, when the run starts writing): the
    command line checks every job's workdir this way before any job runs."""
    check_writable(workdir, process)
    path = lock_path(os.path.abspath(workdir), process)
    if path in _held or not os.path.exists(path):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise _in_use(workdir, fd) from None
    finally:
        os.close(fd)


def check_writable(workdir: str, process: int = 0) -> None:
    """Refuse a workdir in which this run could not write all it writes: the directory, its
    lock, `train.log`, `.hydra/` and `checkpoints/` where they exist (an earlier run's), or, for
    a workdir still to be made, the nearest directory above it. The kernel is asked (`access`:
    mode bits, ACLs, read-only mounts), so finding out creates nothing."""
    workdir = os.path.abspath(workdir)
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise ZooError(f"workdir={workdir} is a file, not a directory: give a directory path.")
    if not os.path.exists(workdir):
        above = os.path.dirname(workdir)
        while not os.path.exists(above):
            above = os.path.dirname(above)
        written = [(above, True)]
    else:
        written = [
            (workdir, True),
            *((os.path.join(workdir, name), True) for name in WRITTEN_DIRECTORIES),
            (lock_path(workdir, process), False),
            *((os.path.join(workdir, name), False) for name in WRITTEN_FILES),
        ]
    for path, directory in written:
        cause = _cannot_write(path, directory) if os.path.exists(path) else None
        if cause is not None:
            raise _unusable(workdir, cause, path)


def _cannot_write(path: str, directory: bool) -> str | None:
    """Why this process could not write `path` (add files to it, for a directory); None if it
    can."""
    if directory != os.path.isdir(path):
        return os.strerror(errno.ENOTDIR if directory else errno.EISDIR)
    mode = os.W_OK | (os.X_OK if directory else 0)
    if os.access(path, mode, effective_ids=os.access in os.supports_effective_ids):
        return None
    read_only = os.statvfs(path).f_flag & os.ST_RDONLY
    return os.strerror(errno.EROFS if read_only else errno.EACCES)


def _unusable(workdir: str, cause: str, path: str) -> ZooError:
    return ZooError(
        f"Cannot use workdir={workdir}: {cause} ({path}). Nothing was written; give a "
        "directory that this user can create and write, with all that a run writes in it "
        f"({LOG}, .hydra/, checkpoints/, event files), or fix its permissions."
    )


def _in_use(workdir: str, fd: int) -> ZooError:
    return ZooError(
        f"workdir={workdir} is in use by another run ({_read_holder(fd)}): two runs on one "
        "workdir would overwrite each other's checkpoints. Wait for it to end or stop it, or "
        "use another workdir; reading it (zoo.load, fine-tuning from it) is allowed meanwhile."
    )


def _open_lock(workdir: str, path: str, process: int) -> int:
    check_writable(workdir, process)
    try:
        os.makedirs(workdir, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise _unusable(workdir, e.strerror or str(e), e.filename or path) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        error = _in_use(workdir, fd)
        os.close(fd)
        raise error from None
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": started}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder).encode(), 0)
    return fd


def _read_holder(fd: int) -> str:
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {holder['pid']} on host {holder['host']}, started {holder['started']}"
    except (OSError, ValueError, KeyError):
        return "its pid is not recorded yet"


def record(
    workdir: str, config: DictConfig, overrides: Sequence[str] | None = None, tokenizer: Any = None
) -> None:
    """The run's resolved config and its command-line overrides, under `<workdir>/.hydra/`; its
    data's tokenizer (a `tokenizers.Tokenizer`), if any, as `<workdir>/tokenizer.json`, where
    generation and export find it whatever becomes of the file the run read it from."""
    directory = os.path.join(workdir, ".hydra")
    try:
        os.makedirs(directory, exist_ok=True)
        if tokenizer is not None:
            replace_file(os.path.join(workdir, TOKENIZER), tokenizer.to_str())
        replace_file(
            os.path.join(directory, "config.yaml"), OmegaConf.to_yaml(config, resolve=True)
        )
        if overrides is not None:
            replace_file(
                os.path.join(directory, "overrides.yaml"), OmegaConf.to_yaml(list(overrides))
            )
    except OSError as e:
        raise ZooError(
            f"Cannot write the run's config into {directory}: {e.strerror or e}. Nothing was "
            "trained; free some space (or fix the permissions) and run the same command again."
        ) from None


def replace_file(path: str, text: str) -> None:
    """Replace `path` whole: a reader never sees half a file."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


class _LogFile(logging.FileHandler):
    """`train.log`: a write that fails (a full disk) ends the file, never the run."""

    failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        self.failed = True

    def close(self) -> None:
        try:
            super().close()
        except OSError:
            self.failed = True


class RunLog:
    """The log records of a run: held in memory from its start until it is known good, then
    written to `<workdir>/train.log` with every later one (a run that stops on bad input
    before that writes no log at all). Records reach it through the root logger."""

    def __init__(self) -> None:
        self._buffer = logging.handlers.MemoryHandler(capacity=1 << 30, flushLevel=1 << 30)
        self._file: _LogFile | None = None

    def __enter__(self) -> Self:
        logging.getLogger().addHandler(self._buffer)
        return self

    def write_to(self, workdir: str) -> None:
        """From now on, into `<workdir>/train.log`, the records held so far first."""
        self._file = _LogFile(os.path.join(workdir, LOG))
        self._file.setFormatter(logging.Formatter(LOG_FORMAT))
        self._buffer.setTarget(self._file)
        self._buffer.flush()
        root = logging.getLogger()
        root.removeHandler(self._buffer)
        root.addHandler(self._file)

    def __exit__(self, *exc_info: object) -> None:
        root = logging.getLogger()
        root.removeHandler(self._buffer)
        self._buffer.close()
        if self._file is not None:
            root.removeHandler(self._file)
            self._file.close()

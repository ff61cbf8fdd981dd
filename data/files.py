"""Find a data set's files on this machine, or fetch them once into a cache, verified.

Each file is taken from the first place that has it: the directory the user names
(`data.dir`), then the cache, then the directory a system package installs it in. A file found
nowhere is downloaded into the cache.

Verification: a download must match the published SHA-256 of the file before it is kept. It is
hashed while it streams into a temporary file beside its final place, which is renamed into
place only once verified, so the cache never holds a partial or unverified file. A file found
locally is not held to the published sums, since repackagers recompress archives (Debian's
Fashion-MNIST `.gz` files differ from the published ones yet hold the same content) and users
unpack them; the data set's reader checks its structure instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import http.client
import logging
import os
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zoo.plugin import ZooError

CACHE_ENV = "ZOO_DATA_DIR"
"""Environment variable naming the cache root, in place of `$XDG_CACHE_HOME/zoo/datasets`."""

_TIMEOUT_S = 30
_CHUNK = 1 << 20

log = logging.getLogger("zoo")


@dataclasses.dataclass(frozen=True)
class RemoteFile:
    """One file as published, and the other local forms of it that a reader also accepts (the
    file unpacked, an archive already extracted)."""

    name: str
    sha256: str
    local_forms: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class FileSource:
    """Where a data set's files are found or fetched. A file's URL is a base URL + its name;
    the base URLs are tried in order."""

    name: str
    files: tuple[RemoteFile, ...]
    base_urls: tuple[str, ...]
    system_dir: str | None = None
    system_package: str | None = None


def cache_root() -> Path:
    """`$ZOO_DATA_DIR`, else `$XDG_CACHE_HOME/zoo/datasets`, else `~/.cache/zoo/datasets`."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache_home) / "zoo" / "datasets"


def find_or_fetch(
    source: FileSource,
    directory: str | None = None,
    download: bool = True,
    mirror: str | None = None,
) -> dict[str, Path]:
    """The local path of each of `source`'s files (by published name), downloading the missing
    ones into the cache unless `download` is off. `mirror` is a base URL that replaces the
    published ones: it must serve the very same files, since they are held to the same sums."""
    if directory is not None and not Path(directory).expanduser().is_dir():
        raise ZooError(
            f"data.dir={directory} is not a directory: name the directory that holds the "
            f"{source.name} files, or leave data.dir unset to use the cache."
        )
    places = [Path(directory).expanduser()] if directory is not None else []
    places.append(cache_root() / source.name)
    if source.system_dir is not None:
        places.append(Path(source.system_dir))
    base_urls = (mirror.rstrip("/") + "/",) if mirror else source.base_urls
    return {
        file.name: _find(file, places) or _fetch(source, file, places, base_urls, download)
        for file in source.files
    }


def _find(file: RemoteFile, places: list[Path]) -> Path | None:
    for place in places:
        for form in (file.name, *file.local_forms):
            if (place / form).exists():
                return place / form
    return None


def _fetch(
    source: FileSource,
    file: RemoteFile,
    places: list[Path],
    base_urls: tuple[str, ...],
    download: bool,
) -> Path:
    target = cache_root() / source.name / file.name
    failures = []
    if download:
        for base_url in base_urls:
            try:
                _download(base_url + file.name, target, file.sha256)
                return target
            except _TransferFailed as e:
                failures.append(f"downloading {base_url + file.name} failed ({e})")
    else:
        failures.append("downloading is off (data.download=false)")
    forms = " or ".join(repr(form) for form in (file.name, *file.local_forms))
    install = (
        f", install the {source.system_package} package (apt-get install "
        f"{source.system_package}), which puts the files in {source.system_dir}"
        if source.system_package
        else ""
    )
    raise ZooError(
        f"Cannot find the {source.name} file {forms}: looked in "
        f"{', '.join(map(str, places))}; {'; '.join(failures)}. To get it, pass "
        f"data.dir=DIR naming a directory that holds it{install}, or download "
        f"{base_urls[0] + file.name} into {target.parent} yourself."
    )


class _TransferFailed(Exception):
    """This URL did not deliver the file; another one may."""


def _download(url: str, target: Path, sha256: str) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(
            dir=target.parent, prefix=f".{target.name}.", suffix=".part"
        )
    except OSError as e:
        raise ZooError(
            f"Cannot write to the data cache {target.parent} ({e.strerror}): set {CACHE_ENV} to "
            "a writable directory, or pass data.dir=DIR naming a directory with the files."
        ) from None
    log.info("Downloading %s to %s", url, target)
    try:
        os.chmod(handle, 0o644)  # as readable as any other file a user downloads
        with os.fdopen(handle, "wb") as out:
            received, actual = _stream(url, out)
        if actual != sha256:
            raise ZooError(
                f"The download of {target.name} from {url} is not the published file: its "
                f"SHA-256 is {actual}, expected {sha256} ({received:,} bytes received). "
                "Nothing was kept; try again later or from another mirror (data.mirror=URL)."
            )
        os.replace(temporary, target)
    finally:
        Path(temporary).unlink(missing_ok=True)


def _stream(url: str, out) -> tuple[int, str]:
    """Copy `url` into `out`, hashing as it goes: (bytes received, SHA-256)."""
    digest = hashlib.sha256()
    received = 0
    try:
        with urllib.request.urlopen(url, timeout=_TIMEOUT_S) as response:
            announced = response.headers.get("Content-Length", "")
            while chunk := response.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
                received += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise _TransferFailed(_describe(e)) from None
    if announced.isdigit() and received != int(announced):
        raise _TransferFailed(f"the transfer ended after {received:,} of {int(announced):,} bytes")
    return received, digest.hexdigest()


def _describe(error: Exception) -> str:
    if isinstance(error, urllib.error.HTTPError):
        return f"HTTP {error.code} {error.reason}"
    if isinstance(error, urllib.error.URLError):
        return str(error.reason)
    return str(error) or type(error).__name__


def write_atomically(target: Path, write: Callable[[Any], Any]) -> None:
    """A cache entry written by `write(binary file)` to a temporary file and renamed into
    place, so that a killed run leaves no partial entry."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=".", suffix=".part")
    except OSError as e:
        raise ZooError(
            f"Cannot write to the data cache {target.parent} ({e.strerror}): set "
            f"{CACHE_ENV} to a writable directory."
        ) from None
    try:
        with os.fdopen(handle, "wb") as out:
            write(out)
        os.replace(temporary, target)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)

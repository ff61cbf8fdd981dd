"""Finding and fetching data files: lookup order, and downloads from a local HTTP server."""

from __future__ import annotations

import collections
import hashlib
import http.server
import re
import socket
import threading
from pathlib import Path

import pytest
from zoo.data.files import CACHE_ENV, FileSource, RemoteFile, cache_root, find_or_fetch
from zoo.engine.errors import ZooError
from zoo.engine.registry import get_data

CONTENT = {"a.bin.gz": b"first file " * 1000, "b.bin": b"second file"}


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def source(base_url: str = "http://127.0.0.1:9/", system_dir: Path | None = None, **sums):
    files = (
        RemoteFile("a.bin.gz", sums.get("a", sha256(CONTENT["a.bin.gz"])), ("a.bin",)),
        RemoteFile("b.bin", sums.get("b", sha256(CONTENT["b.bin"]))),
    )
    return FileSource("toy", files, (base_url,), system_dir and str(system_dir), "toy-package")


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache" / "toy"


class Server:
    """Serves `files` on 127.0.0.1 and counts the requests; a name in `truncated` is announced
    1,000 bytes longer than it is, then the connection closes."""

    def __init__(self, files: dict[str, bytes], truncated: frozenset[str] = frozenset()):
        self.requests: collections.Counter[str] = collections.Counter()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                name = self.path.rsplit("/", 1)[-1]
                server.requests[name] += 1
                if name not in files:
                    self.send_error(404)
                    return
                self.send_response(200)
                extra = 1000 if name in truncated else 0
                self.send_header("Content-Length", str(len(files[name]) + extra))
                self.end_headers()
                self.wfile.write(files[name])

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.01,), daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@pytest.fixture
def serve():
    servers = []

    def start(files, truncated=frozenset()):
        servers.append(Server(files, frozenset(truncated)))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def closed_port_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}/"


def put(directory: Path, name: str, data: bytes = b"x") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_bytes(data)
    return directory / name


def test_each_file_comes_from_the_first_place_that_has_it(tmp_path, cache):
    user, system = tmp_path / "user", tmp_path / "system"
    toy = source(closed_port_url(), system_dir=system)
    for place in (user, cache, system):
        put(place, "a.bin.gz"), put(place, "b.bin")
    found = find_or_fetch(toy, str(user), download=False)
    assert found == {"a.bin.gz": user / "a.bin.gz", "b.bin": user / "b.bin"}
    (user / "a.bin.gz").unlink()
    assert find_or_fetch(toy, str(user), download=False)["a.bin.gz"] == cache / "a.bin.gz"
    (cache / "a.bin.gz").unlink()
    (user / "b.bin").unlink()
    found = find_or_fetch(toy, str(user), download=False)
    assert found == {"a.bin.gz": system / "a.bin.gz", "b.bin": cache / "b.bin"}
    put(cache, "a.bin")
    assert find_or_fetch(toy, str(user), download=False)["a.bin.gz"] == cache / "a.bin"


def test_a_missing_directory_is_refused(tmp_path, cache):
    with pytest.raises(ZooError, match=r"data.dir=.*nowhere is not a directory"):
        find_or_fetch(source(), str(tmp_path / "nowhere"))


def test_cache_root_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "zoo" / "datasets"
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "data"))
    assert cache_root() == tmp_path / "data"


def test_a_download_lands_in_the_cache_once(cache, serve):
    server = serve(CONTENT)
    for _ in range(2):
        found = find_or_fetch(source(server.url))
        assert found == {name: cache / name for name in CONTENT}
        assert {name: path.read_bytes() for name, path in found.items()} == CONTENT
    assert server.requests == {name: 1 for name in CONTENT}
    assert sorted(p.name for p in cache.iterdir()) == sorted(CONTENT)


def test_a_checksum_mismatch_keeps_nothing(cache, serve):
    server = serve(CONTENT)
    expected = "0" * 64
    with pytest.raises(ZooError) as error:
        find_or_fetch(source(server.url, b=expected))
    message = str(error.value)
    assert "b.bin" in message and expected in message and sha256(CONTENT["b.bin"]) in message
    assert sorted(p.name for p in cache.iterdir()) == ["a.bin.gz"]


def test_a_truncated_transfer_keeps_nothing(cache, serve):
    server = serve(CONTENT, truncated={"a.bin.gz"})
    with pytest.raises(ZooError, match=f"ended after {len(CONTENT['a.bin.gz']):,} of"):
        find_or_fetch(source(server.url))
    assert list(cache.iterdir()) == []


def test_unreachable_says_where_it_looked_and_how_to_get_the_file(tmp_path, cache):
    url = closed_port_url()
    with pytest.raises(ZooError) as error:
        find_or_fetch(source(url, system_dir=tmp_path / "system"), str(tmp_path))
    message = str(error.value)
    for part in (str(tmp_path), str(cache), str(tmp_path / "system"), url + "a.bin.gz"):
        assert part in message
    assert "data.dir=" in message and "apt-get install toy-package" in message
    assert "\n" not in message


def test_download_off_never_fetches(cache, serve):
    server = serve(CONTENT)
    with pytest.raises(ZooError, match=r"downloading is off \(data.download=false\)"):
        find_or_fetch(source(server.url), download=False)
    assert not server.requests


def test_a_mirror_serving_other_files_fails_the_published_sums(cache, serve):
    server = serve({"train-images-idx3-ubyte.gz": b"not mnist"})
    with pytest.raises(ZooError) as error:
        get_data("mnist").splits({"mirror": server.url.rstrip("/")})
    assert re.search(r"train-images-idx3-ubyte\.gz from http://127\.0\.0\.1:\d+/", str(error.value))
    assert "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609" in str(error.value)
    assert not (cache.parent / "mnist" / "train-images-idx3-ubyte.gz").exists()


def test_a_missing_file_on_the_server_is_reported(cache, serve):
    server = serve({"a.bin.gz": CONTENT["a.bin.gz"]})
    with pytest.raises(ZooError, match=r"b\.bin failed \(HTTP 404"):
        find_or_fetch(source(server.url))

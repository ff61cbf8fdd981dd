"""TensorBoard as a user sees it: small runs of several models in one logdir, screenshots of its
tabs taken by a headless Chromium.

    python -m benchmarks.tensorboard_screens --out /tmp/screens

Trains through the command line, into `<out>/runs`: `xor` (with a profiler trace), an `mlp` (with
histograms) and a `cnn` on the digits, a `cnn` on Fashion-MNIST (stopped at step 40, then
resumed to 80 by the same command with more steps), a `vae` on Fashion-MNIST and a small `gpt`.
Then starts `tensorboard --logdir <out>/runs` on a free localhost port and writes
`<out>/<view>.png` for the landing page (Time Series), Scalars, HParams, Images, Text (all of it,
and filtered to gpt's `sample`) and Profile (xor's trace), and reads which Time Series cards the
first screen shows. Prints a table of the screenshots and a JSON line.
Needs the `profile` extra and Debian's `chromium` (`apt-get install chromium`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

QUICK = ("trainer.log_every=10", "trainer.eval_every=20")
DIGITS = ("data=digits", "trainer.batch_size=64")
FASHION = ("data=fashion_mnist", "trainer.batch_size=64")
RUNS = {
    "xor": (
        "model=xor",
        "trainer.steps=200",
        "trainer.log_every=50",
        "trainer.profile_steps=[5,15]",
    ),
    "mlp-digits": (
        *("model=mlp", "model.hidden_sizes=[32]", *DIGITS, "trainer.steps=60", *QUICK),
        "logging.histogram_every=20",
    ),
    "cnn-digits": ("model=cnn", "model.channels=[8,16,16]", *DIGITS, "trainer.steps=60", *QUICK),
    "vae-fashion": ("model=vae", "model.hidden_sizes=[64]", *FASHION, "trainer.steps=40", *QUICK),
    "gpt": (
        "model=gpt",
        *("model.dim=32", "model.depth=1", "model.context_length=64", "data.window=64"),
        *("data.eval_bytes=8192", "trainer.steps=40", *QUICK),
    ),
}
RESUMED = ("cnn-fashion", ("model=cnn", "model.channels=[8,16,16]", *FASHION, *QUICK), (40, 80))
VIEWS = {
    "landing": "/",
    "scalars": "/#scalars",
    "hparams": "/#hparams",
    "images": "/#images",
    "text": "/#text",
    "text-sample": "/#text&tagFilter=sample",
    "profile": "/#profile",
}
CHROMIUM_FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    # a machine without a network: nothing to fetch, nothing to wait for
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
SCREEN = (1400, 1000)
"""The first screen: what a browser window of this many pixels shows before any scrolling."""
VIRTUAL_TIME_MS = 20_000
"""How long the page runs before Chromium writes it: TensorBoard's charts need about 20 s of
(virtual) time on 2 cores."""
DRAW_MARGIN = 200
"""TensorBoard's Time Series draws a card once the card comes within this many pixels of the
window (the cards' intersection-observer margin)."""


def train(workdir: Path, args: tuple[str, ...]) -> None:
    command = [sys.executable, "-m", "zoo.train", *args, f"workdir={workdir}"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr}")


def train_all(logdir: Path) -> None:
    for name, args in RUNS.items():
        train(logdir / name, args)
    name, args, (first, last) = RESUMED
    for steps in (first, last):  # the second command resumes the first's run
        train(logdir / name, (*args, f"trainer.steps={steps}"))


def find_chromium() -> str:
    """The path of Debian's `chromium`; a message saying how to install it when missing."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise RuntimeError(
            "No chromium on PATH: install Debian's package as root with `apt-get update && "
            "apt-get install -y chromium` (.ci/run installs it when missing)."
        )
    return browser


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@contextlib.contextmanager
def tensorboard(logdir: Path, reload_interval: int = 1) -> Iterator[str]:
    """A real `tensorboard` process serving `logdir` on a free localhost port, listening when
    this yields its URL; ended by its pid afterwards."""
    port = free_port()
    executable = os.path.join(os.path.dirname(sys.executable), "tensorboard")
    server = subprocess.Popen(
        [
            executable,
            f"--logdir={logdir}",
            "--host=127.0.0.1",
            f"--port={port}",
            f"--reload_interval={reload_interval}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(f"{base}/data/runs")
        yield base
    finally:
        os.kill(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def fetch_json(url: str, body: dict | None = None) -> Any:
    """A GET (a POST of `body` as JSON) to TensorBoard's HTTP API, its JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if body is not None else {}
    request = urllib.request.Request(url, data, headers)
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())


def wait_for_tags(
    base: str, plugin: str, expected: Mapping[str, Iterable[str]], limit_s: float = 120
) -> None:
    """Until the server at `base` has loaded every expected tag of `plugin`, by run."""
    deadline = time.monotonic() + limit_s
    while True:
        loaded = fetch_json(f"{base}/data/plugin/{plugin}/tags")
        missing = {run: set(tags) - set(loaded.get(run, {})) for run, tags in expected.items()}
        if not any(missing.values()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{plugin} tags never loaded in {limit_s:.0f} s: {missing}")
        time.sleep(0.5)


def chromium(browser: str, url: str, *args: str, window: tuple[int, int] = SCREEN) -> bytes:
    """Open `url` in a headless Chromium with a fresh profile, a `window`-sized window, and
    `args` (`--screenshot=...`, `--dump-dom`); its standard output."""
    with tempfile.TemporaryDirectory() as profile:
        command = [
            browser,
            *CHROMIUM_FLAGS,
            f"--virtual-time-budget={VIRTUAL_TIME_MS}",
            f"--window-size={window[0]},{window[1]}",
            f"--user-data-dir={profile}",
            *args,
            url,
        ]
        return subprocess.run(command, capture_output=True, check=True, timeout=120).stdout


def screenshot(browser: str, url: str, path: Path) -> None:
    chromium(browser, url, f"--screenshot={path}")


@dataclasses.dataclass(frozen=True)
class Card:
    """A card of the Time Series tab: its group, and if TensorBoard has drawn it, its title and
    its text (a chart's axis ticks, and its data table's rows: run, value, step, ...)."""

    group: str
    title: str | None = None
    text: str = ""


def time_series_cards(browser: str, base: str) -> tuple[list[str], list[Card]]:
    """The Time Series tab (TensorBoard's landing page) in a fresh browser: its tag groups and
    the cards of its open groups, in page order, the cards that start on the first screen drawn
    (titled) and the others not. TensorBoard draws a card that comes within `DRAW_MARGIN` pixels
    of the window, so the page is read from a window that much shorter than `SCREEN`."""
    window = (SCREEN[0], SCREEN[1] - DRAW_MARGIN)
    dom = chromium(browser, f"{base}/", "--dump-dom", window=window).decode()
    margins = set(re.findall(r'intersectionobservermargin="([^"]*)"', dom))
    if margins - {" ".join([f"{DRAW_MARGIN}px"] * 4)}:
        raise RuntimeError(f"TensorBoard draws cards at other margins than assumed: {margins}")
    groups: list[str] = []
    cards: list[Card] = []
    pattern = r'class="group-title" title="([^"]*)"|<card-view-component[^>]*>'
    for match in re.finditer(pattern, dom):
        if match.group(1) is not None:
            groups.append(match.group(1))
            continue
        card = dom[match.end() : dom.find("</card-view-component>", match.end())]
        drawn = re.search(r'<[a-z]+-card[ >].*?title="([^"]*)"', card, re.DOTALL)
        if drawn is None:
            cards.append(Card(groups[-1]))
            continue
        text = " ".join(re.sub(r"<[^>]*>", " ", card).split())
        cards.append(Card(groups[-1], drawn.group(1), text))
    return groups, cards


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="screenshots and runs go here")
    parser.add_argument("--reuse-runs", action="store_true", help="keep <out>/runs if there")
    args = parser.parse_args()
    browser = find_chromium()
    logdir = args.out / "runs"
    if not (args.reuse_runs and logdir.is_dir()):
        shutil.rmtree(logdir, ignore_errors=True)
        train_all(logdir)
    runs = [run.name for run in logdir.iterdir() if run.is_dir()]
    shots = {}
    with tensorboard(logdir) as base:
        wait_for_tags(base, "scalars", {run: ["train/loss"] for run in runs})
        for view, path in VIEWS.items():
            target = args.out / f"{view}.png"
            screenshot(browser, base + path, target)
            shots[view] = {"url": path, "file": str(target), "bytes": target.stat().st_size}
        groups, cards = time_series_cards(browser, base)
    first_screen = [card.title for card in cards if card.title]
    print(f"{'view':<10} {'url':<12} {'bytes':>9}  file")
    for view, shot in shots.items():
        print(f"{view:<10} {shot['url']:<12} {shot['bytes']:>9}  {shot['file']}")
    print(f"Time Series groups: {', '.join(groups)}; first screen: {', '.join(first_screen)}")
    result = {"logdir": str(logdir), "screenshots": shots, "groups": groups}
    print(json.dumps({**result, "first_screen": first_screen}))


if __name__ == "__main__":
    main()

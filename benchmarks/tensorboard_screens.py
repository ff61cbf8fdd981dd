"""TensorBoard as a user sees it: small runs of several models in one logdir, screenshots of its
tabs taken by a headless Chromium.

    python -m benchmarks.tensorboard_screens --out /tmp/screens

Trains through the command line, into `<out>/runs`: `xor` (with a profiler trace), an `mlp` and a `cnn` on the digits,
a `cnn` on Fashion-MNIST (stopped at step 40, then resumed to 80 by the same command with more
steps), a `vae` on Fashion-MNIST and a small `gpt`. Then starts `tensorboard --logdir
<out>/runs` on a free localhost port and writes `<out>/<view>.png` for the landing page (Time
Series), Scalars, HParams, Images, Text (all of it, and filtered to gpt's `sample`) and Profile
(xor's trace). Prints a table of the screenshots and a JSON line.
Needs the `profile` extra and Debian's `chromium` (`apt-get install chromium`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

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
    "mlp-digits": ("model=mlp", "model.hidden_sizes=[32]", *DIGITS, "trainer.steps=60", *QUICK),
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
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--virtual-time-budget=20000",
    "--window-size=1400,1000",
)


def train(workdir: Path, args: tuple[str, ...]) -> None:
    command = [sys.executable, "-m", "zoo.train", *args, f"workdir={workdir}"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr}")


def train_all(logdir: Path) -> list[str]:
    for name, args in RUNS.items():
        train(logdir / name, args)
    name, args, (first, last) = RESUMED
    for steps in (first, last):  # the second command resumes the first's run
        train(logdir / name, (*args, f"trainer.steps={steps}"))
    return [*RUNS, name]


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


def screenshot(browser: str, url: str, path: Path) -> None:
    with tempfile.TemporaryDirectory() as profile:
        command = [
            browser,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            f"--screenshot={path}",
            url,
        ]
        subprocess.run(command, capture_output=True, check=True, timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="screenshots and runs go here")
    parser.add_argument("--reuse-runs", action="store_true", help="keep <out>/runs if there")
    args = parser.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("No chromium on PATH: apt-get install chromium")
    logdir = args.out / "runs"
    if not (args.reuse_runs and logdir.is_dir()):
        shutil.rmtree(logdir, ignore_errors=True)
        train_all(logdir)
    port = free_port()
    tensorboard = os.path.join(os.path.dirname(sys.executable), "tensorboard")
    server = subprocess.Popen(
        [tensorboard, f"--logdir={logdir}", "--host=127.0.0.1", f"--port={port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    shots = {}
    try:
        wait_for(f"{base}/data/runs")
        time.sleep(5)  # the first load of the event files
        for view, path in VIEWS.items():
            target = args.out / f"{view}.png"
            screenshot(browser, base + path, target)
            shots[view] = {"url": path, "file": str(target), "bytes": target.stat().st_size}
    finally:
        os.kill(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    print(f"{'view':<10} {'url':<12} {'bytes':>9}  file")
    for view, shot in shots.items():
        print(f"{view:<10} {shot['url']:<12} {shot['bytes']:>9}  {shot['file']}")
    print(json.dumps({"logdir": str(logdir), "screenshots": shots}))


if __name__ == "__main__":
    main()

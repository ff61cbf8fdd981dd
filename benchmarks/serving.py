"""Serving speed: output tokens/s and time to first token of `zoo.serve` (continuous batching)
at 1, 8 and 32 concurrent streaming clients (`--clients`), against `zoo.generate` on the same
prompts in one batch and one at a time, in one process on this machine.

    python -m benchmarks.serving --json runs/bench/serving.json

The model: `--model` (default: the tiny Qwen 3 chat fixture of the test suite, a few hundred
thousand parameters, so that the figures measure the engine and the HTTP layer more than the
model's arithmetic). `--requests` prompts of 1 to 100 characters, each asking for
`--max-tokens` new tokens, greedily; a reply may end earlier at the end-of-sequence id, so the
tokens counted are those written. The server (`python -m zoo.serve`, a process of its own)
holds 32 rows (`--rows`) of 256 slots (`--max-length`) and is called through the `openai`
client over HTTP on 127.0.0.1, from threads of this process; each client sends its next
request when its last reply ends. Time to first token: from a request's sending to its first
streamed token (for `zoo.generate`, which returns whole texts, to its text; every request of a
batch or a queue is sent at the start). The server's figures come after a warm-up round;
`zoo.generate`'s after a warm-up call of each shape.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from benchmarks.machine import cpu

ROOT = Path(__file__).resolve().parent.parent
CHAT = ROOT / "tests" / "fixtures" / "pretrained" / "qwen3-chat"
CLIENTS = (1, 8, 32)


@contextlib.contextmanager
def serving(model: str, *options: str) -> Iterator:
    """An `openai` client of `python -m zoo.serve MODEL OPTIONS...`, run in a process of its
    own (its clients' threads then do not hold the server's interpreter), until the block
    ends."""
    import openai

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "zoo.serve", model, f"port={port}", "name=bench", *options]
    server = subprocess.Popen(command)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    try:
        while True:  # until it has compiled its engine
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                time.sleep(0.5)
        yield client
    finally:
        server.terminate()
        server.wait()


def prompts(count: int) -> list[str]:
    return [("The quick brown fox " * 6)[: 1 + (i * 37) % 100] for i in range(count)]


def served(client, asks: list[str], clients: int, max_tokens: int) -> dict:
    """Tokens/s and times to first token of `asks` sent by `clients` streaming clients."""

    def one(prompt: str) -> tuple[float, int]:
        sent, first, tokens = time.perf_counter(), None, 0
        stream = client.completions.create(
            model="bench", prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        for chunk in stream:
            if chunk.choices and first is None:
                first = time.perf_counter() - sent
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return first, tokens

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        done = list(pool.map(one, asks))
    return figures(time.perf_counter() - start, [d[1] for d in done], [d[0] for d in done])


def generated(model, asks: list[str], max_tokens: int, batched: bool) -> dict:
    """The same figures for `zoo.generate`, in one batch or one prompt after the other."""
    import zoo

    start, firsts, tokens = time.perf_counter(), [], []
    for group in [asks] if batched else [[a] for a in asks]:
        done = zoo.generate(model, group, max_new_tokens=max_tokens, temperature=0.0, logprobs=True)
        firsts += [time.perf_counter() - start] * len(group)
        tokens += [len(d.tokens) for d in done]
    return figures(time.perf_counter() - start, tokens, firsts)


def figures(seconds: float, tokens: list[int], firsts: list[float]) -> dict:
    return {
        "tokens": int(sum(tokens)),
        "tokens_per_s": sum(tokens) / seconds,
        "ttft_p50_s": float(np.percentile(firsts, 50)),
        "ttft_p95_s": float(np.percentile(firsts, 95)),
    }


def main(argv: list[str] | None = None) -> dict:
    """Measure, print the table and write the JSON (`--json`); the report. `--clients`,
    `--rows` and `--max-length` shrink the run (the tests' smoke run: two rows of 32 slots)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(CHAT))
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--clients", type=int, nargs="+", default=list(CLIENTS))
    parser.add_argument("--rows", type=int, default=32, help="the server's rows")
    parser.add_argument("--max-length", type=int, default=256, help="the server's max_length")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    import jax

    from zoo.loading import load

    model = load(args.model, devices=jax.devices()[:1])
    asks = prompts(args.requests)
    report = {"machine": cpu(), "model": args.model, "requests": args.requests,
              "max_tokens": args.max_tokens, "server_rows": args.rows,
              "max_length": args.max_length, "rows": {}}  # fmt: skip
    options = (f"rows={args.rows}", f"max_length={args.max_length}", f"queue_size={args.requests}")
    with serving(args.model, *options) as client:
        served(client, asks, max(args.clients), args.max_tokens)  # warm-up
        for clients in args.clients:
            said = f"{clients} client" + "s" * (clients > 1)
            report["rows"][f"zoo.serve, {said}"] = served(client, asks, clients, args.max_tokens)
    for batched, label in ((True, "one batch"), (False, "one at a time")):
        generated(model, asks, args.max_tokens, batched)  # warm-up
        report["rows"][f"zoo.generate, {label}"] = generated(model, asks, args.max_tokens, batched)
    print(table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    return report


def table(report: dict) -> str:
    lines = [
        "| how | output tokens/s | time to first token p50 | p95 |",
        "|---|---|---|---|",
    ]
    for how, row in report["rows"].items():
        lines.append(
            f"| {how} | {row['tokens_per_s']:.0f} | {row['ttft_p50_s'] * 1000:.0f} ms "
            f"| {row['ttft_p95_s'] * 1000:.0f} ms |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""Batches made in Grain worker processes (`data.workers`): the same batches as without
workers, an iterator state that resumes at any worker count, kill -9 then resume with the same
bits, and every process of a multi-process run reading only its share."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import ROOT, overriding
from image_files import RUN_ARGS as ARGS
from zoo.engine.checkpoints.resume import config_changes
from zoo.engine.pipeline import batches as pipeline


class RowSource(pipeline.ExampleSource):
    """Each example is its own row, epoch and a seeded draw: what a batch holds shows where it
    came from."""

    def __len__(self) -> int:
        return 50

    def examples(self, rows, epochs, seed):
        draws = [np.random.default_rng([seed, r, e]).random() for r, e in zip(rows, epochs)]
        return {"row": rows.copy(), "epoch": epochs.copy(), "draw": np.asarray(draws)}


def batches(iterator, count):
    return [next(iterator) for _ in range(count)]


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for name in x:
            np.testing.assert_array_equal(x[name], y[name], err_msg=name)


@pytest.fixture(scope="module")
def inline():
    iterator = iter(pipeline.train_batches(RowSource(), 16, seed=3))
    return batches(iterator, 8)


def test_workers_make_the_inline_batches_and_resume_at_any_worker_count(inline):
    dataset = pipeline.train_batches(RowSource(), 16, seed=3, workers=2)
    iterator = iter(dataset)
    try:
        assert_same_batches(batches(iterator, 4), inline[:4])
        state = iterator.get_state()
    finally:
        iterator.close()
    assert state == {"next_index": 4}
    for workers in (0, 1):
        resumed = iter(pipeline.train_batches(RowSource(), 16, seed=3, workers=workers))
        resumed.set_state(state)
        try:
            assert_same_batches(batches(resumed, 4), inline[4:])
        finally:
            resumed.close()
    assert_same_batches([pipeline.peek(dataset)], inline[:1])


def test_each_process_makes_only_its_share_of_every_batch(inline):
    shares = []
    for index in range(2):
        dataset = pipeline.train_batches(RowSource(), 16, seed=3, shard_index=index, shard_count=2)
        iterator = iter(dataset)
        try:
            shares.append(batches(iterator, 8))
        finally:
            iterator.close()
    for whole, first, second in zip(inline, *shares, strict=True):
        for name in whole:
            np.testing.assert_array_equal(whole[name], np.concatenate([first[name], second[name]]))


def test_a_changed_worker_count_is_allowed_on_resume():
    refused, allowed = config_changes({"data": {"workers": 2}}, {"data": {"workers": 0}})
    assert (refused, allowed) == ([], ["data.workers: 2 -> 0"])


# ---- Real runs ----


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_processes_of_a_multi_process_run_read_disjoint_shares(image_folder, tmp_path):
    env = {**os.environ, "ZOO_PLUGINS": "read_log", "PYTHONPATH": str(ROOT / "tests")}
    env["ZOO_READ_LOG"] = str(tmp_path / "reads")
    env.pop("JAX_NUM_CPU_DEVICES", None)
    port = free_port()
    common = [
        *overriding(*ARGS, "trainer.steps=8"),
        f"data.path={image_folder}",
        f"workdir={tmp_path / 'run'}",
        "mesh.cpu_devices=2",
        f"distributed.coordinator=127.0.0.1:{port}",
        "distributed.num_processes=2",
    ]
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "zoo.train", *common, f"distributed.process_id={i}"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for process in processes:
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr
    logs = sorted(tmp_path.glob("reads.*"))
    assert len(logs) == 2
    reads = [log.read_text().splitlines() for log in logs]
    # Each process made half of every batch of 16 (a peek at batch 0 and 8 steps), and no
    # (image, epoch) twice between them.
    assert [len(r) for r in reads] == [9 * 8, 9 * 8]
    first = {line for line in reads[0][8:]}
    second = {line for line in reads[1][8:]}
    assert len(first) == len(second) == 8 * 8
    assert not first & second

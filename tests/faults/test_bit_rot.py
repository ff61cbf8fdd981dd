"""A bit flipped in a checkpoint's array data. The storage library reads the damaged file back
without complaint, as different numbers; the checksums saved with the checkpoint catch it, and
it is treated like an unreadable checkpoint: `zoo.load` and resume fall back to the one before,
saying so, and the resumed run ends with the bits of an uninterrupted run."""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
from fault_tools import MLP, assert_same_arrays, final_arrays, run

import zoo

ARGS = (*MLP, "optimizer.schedule=constant", "trainer.checkpoint_every=100", "trainer.keep=10")


def data_files(step_dir: Path) -> list[Path]:
    """The checkpoint's array data files, largest first."""
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    return sorted(files, key=lambda p: p.stat().st_size, reverse=True)


def flip_a_silent_bit(workdir: Path, step: int) -> str:
    """Flip one bit of the array data of the checkpoint at `step` such that the storage library
    still reads it, as other numbers in one of the model's arrays (`state/0/...`, what
    `zoo.load` reads too); returns that array's name."""
    healthy = final_arrays(workdir, step)
    rng = random.Random(0)
    # Orbax's files hold compressed chunks of several arrays and the storage's own index, laid
    # out differently from run to run (writes are concurrent): try anywhere in each file, and
    # enough times that a file holding a model array is found whatever the layout (a read
    # takes ~0.05 s; one of the first few flips usually does it).
    for target in data_files(workdir / "checkpoints" / str(step)):
        original = target.read_bytes()
        for _ in range(200):
            damaged = bytearray(original)
            where = rng.randrange(len(damaged))
            damaged[where] ^= 1 << rng.randrange(8)
            target.write_bytes(bytes(damaged))
            try:
                read = final_arrays(workdir, step)
            except Exception:  # noqa: BLE001, S112  (this flip broke the framing: it would be caught anyway)
                continue
            changed = [n for n in healthy if not np.array_equal(healthy[n], read[n])]
            if changed and changed[0].startswith("state/0/"):
                return changed[0]
        target.write_bytes(original)
    pytest.fail("no flipped bit was read back silently")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A run saved at steps 100 and 200 with a bit flipped in step 200 (kept pristine in
    `healthy`), and an uninterrupted run to step 300."""
    root = tmp_path_factory.mktemp("rot")
    status, stderr, _ = run(*ARGS, "trainer.steps=200", f"workdir={root / 'healthy'}")
    assert status == 0, stderr
    status, stderr, _ = run(*ARGS, "trainer.steps=300", f"workdir={root / 'reference'}")
    assert status == 0, stderr
    shutil.copytree(root / "healthy", root / "damaged")
    changed = flip_a_silent_bit(root / "damaged", 200)
    return root, changed


def test_the_flipped_bit_is_read_back_as_other_numbers_without_an_error(runs):
    root, changed = runs
    healthy, damaged = final_arrays(root / "healthy", 200), final_arrays(root / "damaged", 200)
    assert not np.array_equal(healthy[changed], damaged[changed])


def test_load_falls_back_to_the_checkpoint_before_naming_the_damaged_array(runs, caplog):
    root, changed = runs
    with caplog.at_level(logging.WARNING, logger="zoo"):
        loaded = zoo.load(root / "damaged")
    assert loaded.step == 100
    warning = caplog.text
    assert "Skipped the checkpoint at step 200" in warning and "checksum mismatch" in warning
    assert changed.replace("state/", "") in warning or changed in warning
    with pytest.raises(zoo.ZooError, match=r"step 200 .*checksum mismatch"):
        zoo.load(root / "damaged", step=200)
    assert (root / "damaged" / "checkpoints" / "200").is_dir()  # loading changes nothing


def test_resume_sets_the_damaged_checkpoint_aside_and_ends_with_the_same_bits(runs, tmp_path):
    root, _ = runs
    workdir = tmp_path / "run"
    shutil.copytree(root / "damaged", workdir)
    status, stderr, _ = run(*ARGS, "trainer.steps=300", f"workdir={workdir}")
    assert status == 0, stderr
    assert "checksum mismatch" in stderr and "Falling back to step 100" in stderr
    assert (workdir / "checkpoints" / "200.unreadable").is_dir()
    assert_same_arrays(final_arrays(workdir, 300), final_arrays(root / "reference", 300))


def test_a_truncated_latest_checkpoint_falls_back_quietly(runs, tmp_path, caplog):
    """A truncated data file fails the read itself: `zoo.load` falls back as resume does, and the
    command line says so in one line, without the storage library's aftershocks."""
    root, _ = runs
    workdir = tmp_path / "run"
    shutil.copytree(root / "healthy", workdir)
    for data in (workdir / "checkpoints" / "200" / "state").rglob("d/*"):
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="zoo"):
        assert zoo.load(workdir).step == 100
    assert "Skipped the checkpoint at step 200" in caplog.text
    status, stderr, _ = run(*ARGS, "trainer.steps=300", f"workdir={workdir}")
    assert status == 0, stderr
    warnings = [line for line in stderr.splitlines() if "cannot be read" in line]
    assert len(warnings) == 1 and "Falling back to step 100" in warnings[0], stderr
    for noise in ("Traceback", "Exception ignored", "Event loop is closed", "<bound method"):
        assert noise not in stderr, stderr

"""Every test sees 8 simulated CPU devices, in this process and in the CLI subprocesses."""

import atexit
import os
import shutil
import sys
import tempfile
from importlib.metadata import version


def _temporary_dir(prefix: str) -> str:
    """A new directory, removed when this process exits."""
    path = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


os.environ["JAX_NUM_CPU_DEVICES"] = "8"
# Data caches (tokenized text, image statistics, downloads) go to a directory of this process,
# never into the user's ~/.cache; Fashion-MNIST and the like are still found where a system
# package installs them.
os.environ["ZOO_DATA_DIR"] = _temporary_dir("zoo-test-data-")
# zoo's compiled CPU kernels (`zoo.engine.kernels.bf16_rows`) too: compiled once in the session.
if "ZOO_KERNEL_DIR" not in os.environ:
    os.environ["ZOO_KERNEL_DIR"] = _temporary_dir("zoo-test-kernels-")
# One JAX persistent compilation cache for the session's processes (pytest's workers inherit the
# directory the first process made, and pass it on to the runs they start): a kill-and-resume
# test compiles the same steps in up to three processes. No size limit: with one, jax lists the
# whole directory at every write to find what to evict, and with the thousands of small entries
# a session writes that made the tests that compile most (trainer.debug's eager ops) five times
# slower. Without the limit's file lock, a process that reads an entry while another writes it
# warns and compiles it itself. Tests that count compilations turn the cache off
# (`fresh_compiles`, `NO_COMPILE_CACHE`).
if "ZOO_TEST_COMPILE_CACHE" not in os.environ:
    os.environ["ZOO_TEST_COMPILE_CACHE"] = _temporary_dir("zoo-test-xla-")
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["ZOO_TEST_COMPILE_CACHE"]
# The session's processes share one cache of compiled Python bytecode too, outside the checkout:
# the suite starts a few hundred subprocesses (`python -m zoo.train ...`), and each one compiling
# zoo's sources again (as it does where PYTHONDONTWRITEBYTECODE is set, or the checkout is
# read-only) took about 0.25 of its 1.7 CPU seconds of start-up.
if "PYTHONPYCACHEPREFIX" not in os.environ:
    os.environ["PYTHONPYCACHEPREFIX"] = _temporary_dir("zoo-test-pycache-")
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.pycache_prefix, sys.dont_write_bytecode = os.environ["PYTHONPYCACHEPREFIX"], False
os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = "-1"
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
# 8 simulated devices share 2 cores here. Rarely (seen twice in about 40 runs under heavy load)
# one device never reached the first all-reduce of a run and XLA:CPU aborted after 40 s. Eigen's
# shared intra-op pool is a reported cause of such wedges, and buys nothing with 8 devices on 2
# cores, so it is off; a later arrival than 40 s under load is tolerated up to 120 s.
# Compiling dominates the suite's time: XLA:CPU's backend optimisations (LLVM) are off, which
# takes about 30% off the CPU time of tests that train (tests/conformance/test_conformance_runs.py
# -k "mlp or cnn", imports included: 29 CPU seconds with them on, 21 off). Every comparison in the
# suite is between programs compiled alike or against references at a tolerance, so it holds
# either way; flags already in XLA_FLAGS come last and win. Where XLA:CPU can still emit fusions
# the older way (jaxlib 0.10; from 0.11 its MLIR fusion emitters are the only ones, and XLA
# aborts on a flag it does not know), the MLIR emitters are off as well, which takes about a
# third off the compilations again. Off, a layer initialised under `vmap` (scan_layers) rounds
# 1 ulp away from the same layer initialised alone, where the emitters users run with give the
# same bits: the checks of those bits run in a process of their own with the emitters on
# (`compiled_as_users`).
# XLA:CPU splits a program's generated code into 32 modules compiled side by side, each a clone
# of the program; on 2 cores one module takes about 12% off a compilation's CPU time (the
# decoder's tiny train step on 8 devices: 0.76 against 0.86 CPU seconds), the same code.
OLDER_EMITTERS = tuple(map(int, version("jaxlib").split(".")[:2])) < (0, 11)
os.environ["XLA_FLAGS"] = " ".join(
    [
        "--xla_backend_optimization_level=0",
        "--xla_llvm_disable_expensive_passes=true",
        *(["--xla_cpu_use_fusion_emitters=false"] if OLDER_EMITTERS else []),
        "--xla_cpu_parallel_codegen_split_count=1",
        "--xla_cpu_multi_thread_eigen=false",
        "--xla_cpu_collective_call_terminate_timeout_seconds=120",
        os.environ.get("XLA_FLAGS", ""),
    ]
).strip()

import jax
import pytest
from image_files import write_folder
from jax.experimental.compilation_cache import compilation_cache

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture
def fresh_compiles():
    """This process compiles without the session's compilation cache: every jit compiles."""
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """Three classes of ten small images, every format and mode in turn (`image_files`)."""
    root = tmp_path_factory.mktemp("images")
    write_folder(root, per_class=10)
    return root


LONGEST_FIRST = (
    "tests/docs/test_doc_examples.py",
    "tests/models/test_decoder_pretrained.py",
    "tests/faults/test_kill_pretrained.py",
    "tests/front/test_benchmarks.py",
    "tests/front/test_finetune_experts.py",
    "tests/train/test_resume.py",
    "tests/models/test_decoder.py",
    "tests/train/test_posttraining_model_parity.py",
    "tests/front/test_finetune_dpo.py",
    "tests/train/test_precision.py",
    "tests/front/test_finetune_grpo.py",
    "tests/front/test_finetune_deepseek.py",
    "tests/front/test_cli.py",
    "tests/train/test_layering.py",
    "tests/conformance/test_conformance_families.py",
    "tests/faults/test_kill.py",
    "tests/conformance/test_conformance_runs.py",
    "tests/front/test_lm_eval.py",
    "tests/train/test_multiprocess.py",
    "tests/train/test_qlora.py",
    "tests/models/test_gpt.py",
    "tests/front/test_costs_benchmark.py",
    "tests/train/test_sharding.py",
    "tests/front/test_bad_input.py",
    "tests/models/test_generation.py",
    "tests/front/test_finetune.py",
    "tests/train/test_tensorboard.py",
    "tests/front/test_finetune_vision.py",
    "tests/front/test_hub.py",
    "tests/models/test_bf16_rows.py",
    "tests/faults/test_permissions.py",
    "tests/train/test_tensorboard_screen.py",
    "tests/data/test_own_images.py",
    "tests/faults/test_disk_full.py",
    "tests/faults/test_bit_rot.py",
    "tests/train/test_param_dtype.py",
)
"""The files that take longest (2-core CI, 25 s and more), in that order. pytest-xdist hands each
worker whole files in collection order (`--dist loadfile --no-loadscope-reorder`: without the
latter it would reorder them by their number of tests, and a long file of one test would start
last); these first, so that no long file starts near the end while the other worker has run out
of files."""


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))

"""Every test sees 8 simulated CPU devices, in this process and in the CLI subprocesses."""

import os
import tempfile

os.environ["JAX_NUM_CPU_DEVICES"] = "8"
# Data caches (tokenized text, image statistics, downloads) go to a directory of this session,
# never into the user's ~/.cache; Fashion-MNIST and the like are still found where a system
# package installs them.
os.environ["ZOO_DATA_DIR"] = tempfile.mkdtemp(prefix="zoo-test-data-")
# One JAX persistent compilation cache for the session's processes (pytest's workers inherit the
# directory the first process made, and pass it on to the runs they start): a kill-and-resume
# test compiles the same steps in up to three processes. Its file lock (on with a size limit)
# keeps a reader from seeing an entry half written. Tests that count compilations turn it off
# (`fresh_compiles`, `NO_COMPILE_CACHE`).
os.environ.setdefault("ZOO_TEST_COMPILE_CACHE", tempfile.mkdtemp(prefix="zoo-test-xla-"))
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["ZOO_TEST_COMPILE_CACHE"]
os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(8 << 30)
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
# 8 simulated devices share 2 cores here. Rarely (seen twice in about 40 runs under heavy load)
# one device never reached the first all-reduce of a run and XLA:CPU aborted after 40 s. Eigen's
# shared intra-op pool is a reported cause of such wedges, and buys nothing with 8 devices on 2
# cores, so it is off; a later arrival than 40 s under load is tolerated up to 120 s.
os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_cpu_multi_thread_eigen=false",
        "--xla_cpu_collective_call_terminate_timeout_seconds=120",
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

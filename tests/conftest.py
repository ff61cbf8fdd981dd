"""Every test sees 8 simulated CPU devices, in this process and in the CLI subprocesses."""

import os
import tempfile

os.environ["JAX_NUM_CPU_DEVICES"] = "8"
# Data caches (tokenized text, image statistics, downloads) go to a directory of this session,
# never into the user's ~/.cache; Fashion-MNIST and the like are still found where a system
# package installs them.
os.environ["ZOO_DATA_DIR"] = tempfile.mkdtemp(prefix="zoo-test-data-")
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

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """Three classes of ten small images, every format and mode in turn (`image_files`)."""
    root = tmp_path_factory.mktemp("images")
    write_folder(root, per_class=10)
    return root

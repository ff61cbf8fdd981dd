"""Every test sees 8 simulated CPU devices, in this process and in the CLI subprocesses."""

import os

os.environ["JAX_NUM_CPU_DEVICES"] = "8"
# 8 simulated devices share 2 cores here: under load one device's thread can reach a collective
# long after the others, past XLA:CPU's default 40 s, after which it aborts the process.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_cpu_collective_call_terminate_timeout_seconds=600"]
).strip()

import jax

jax.config.update("jax_num_cpu_devices", 8)

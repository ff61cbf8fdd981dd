"""Every test sees 8 simulated CPU devices, in this process and in the CLI subprocesses."""

import os

os.environ["JAX_NUM_CPU_DEVICES"] = "8"

import jax

jax.config.update("jax_num_cpu_devices", 8)

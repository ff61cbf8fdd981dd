"""`python -m zoo.export WORKDIR OUT_DIR [format=hf|jax] [step=latest|best|N] [weights=raw|ema]
[dtype=float32|bfloat16] [max_shard_size=SIZE]`."""

import sys

from zoo.export import main

sys.exit(main(sys.argv[1:]))

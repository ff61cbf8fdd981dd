"""`python -m zoo.eval MODEL tasks=NAME[,NAME...] [num_fewshot=N] [limit=N] [batch_size=8]
[max_length=N] [include=DIR] [output=FILE] [tensorboard=DIR] [step=latest|best|N] [seed=0]`."""

import sys

from zoo.eval import main

sys.exit(main(sys.argv[1:]))

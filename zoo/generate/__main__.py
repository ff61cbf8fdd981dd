"""`python -m zoo.generate DIR prompt=TEXT [max_new_tokens=...] [temperature=...] [seed=...]`."""

import sys

from zoo.generate import main

sys.exit(main(sys.argv[1:]))

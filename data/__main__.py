"""`python -m zoo.data convert images DIR OUT [--records-per-shard N]`: an image folder into
ArrayRecord shards (see `zoo.data.convert`)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from zoo.data.convert import RECORDS_PER_SHARD, convert_images

from zoo.plugin import ZooError


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zoo.data", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    convert = commands.add_parser("convert", help="convert a data set into ArrayRecord shards")
    convert.add_argument("format", choices=["images"], help="what DIR holds: an image folder")
    convert.add_argument("source", metavar="DIR")
    convert.add_argument("out", metavar="OUT")
    convert.add_argument("--records-per-shard", type=int, default=RECORDS_PER_SHARD)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        count = convert_images(args.source, args.out, args.records_per_shard)
    except ZooError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{count} images written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

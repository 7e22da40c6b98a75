"""`python -m hsx.reference ...`: the same as `hsx reference-server ...`."""

from __future__ import annotations

import argparse
import sys

from hsx.reference import cli


def _main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hsx.reference",
        description=cli.DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cli.add_arguments(parser)
    return cli.main(parser.parse_args())


if __name__ == "__main__":
    sys.exit(_main())

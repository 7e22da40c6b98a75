"""`python -m hsx.reference ...`: the same as `hsx reference-server ...`."""

from __future__ import annotations

import argparse
import sys

from hsx.cli import reference_server


def _main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hsx.reference",
        description=reference_server.DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    reference_server.add_arguments(parser)
    return reference_server.main(parser.parse_args())


if __name__ == "__main__":
    sys.exit(_main())

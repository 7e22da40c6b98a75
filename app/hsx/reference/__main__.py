"""`python -m hsx.reference ...`: the same as `hsx reference-server ...`."""

from __future__ import annotations

import argparse
import sys

from hsx.cli import reference_server
from hsx.cli.extras import run


def _main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hsx.reference",
        description=reference_server.DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    reference_server.add_arguments(parser)
    return run(reference_server.main, parser.parse_args(), "python -m hsx.reference", reference_server.EXTRA)


if __name__ == "__main__":
    sys.exit(_main())

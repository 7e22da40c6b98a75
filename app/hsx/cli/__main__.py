"""`python -m hsx.cli ...`: the same as the `hsx` console script."""

import sys

from hsx.cli import main

sys.exit(main())

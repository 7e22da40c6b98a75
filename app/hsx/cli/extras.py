"""The optional extras of pyproject.toml ([project.optional-dependencies]) that some commands need.

hsx installs without torch or transformers, so that it never replaces a model server's torch. A
command that needs one names its extra as EXTRA in its module; hsx.cli.main turns the
ModuleNotFoundError of one of that extra's packages into one line that says what to install (exit 2),
rather than a traceback that ends far from the answer.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

# Each extra's packages that hsx imports, by their import names.
EXTRAS: dict[str, tuple[str, ...]] = {
    "reference": ("torch", "transformers"),
    "training": ("torch",),
}
# The name pip installs hsx by (the package and the command are hsx).
DISTRIBUTION = "hsx-server"
# How the message names them: PyTorch is what people search for, not "torch".
SHOWN = {"torch": "PyTorch", "transformers": "Hugging Face transformers"}


def missing_extra_line(exc: ModuleNotFoundError, prog: str, extra: str | None) -> str | None:
    """The one line for `exc` when it is a package of `extra` that is not installed; None for any
    other missing module (a broken installation, a bug), which deserves its traceback."""
    package = (exc.name or "").partition(".")[0]
    if extra is None or package not in EXTRAS[extra]:
        return None
    return f'{prog} needs {SHOWN.get(package, package)}: pip install "{DISTRIBUTION}[{extra}]"'


def require(extra: str) -> None:
    """Import the packages of `extra` now: for a command that runs them in processes it starts, so
    that a missing one is said here, before anything has started."""
    for package in EXTRAS[extra]:
        importlib.import_module(package)


Handler = Callable[[argparse.Namespace], "int | None"]


def run(handler: Handler, args: argparse.Namespace, prog: str, extra: str | None) -> int:
    """handler(args)'s exit code; 2, said in one line on stderr, when a package of `extra` is missing."""
    try:
        return int(handler(args) or 0)
    except ModuleNotFoundError as exc:
        line = missing_extra_line(exc, prog, extra)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 2

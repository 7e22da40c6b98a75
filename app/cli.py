"""The `hsx` command line: one subcommand per module listed in COMMANDS.

Each module provides NAME, HELP, DESCRIPTION, add_arguments(parser) and main(args) -> int, and
imports anything heavy (torch, transformers) inside main so that `--help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = [
    "hsx.serve",
    "hsx.reference.cli",
    "hsx.demo",
    "hsx.export_cli",
    "hsx.verify_cli",
    "hsx.commands.submit",
    "hsx.commands.status",
    "hsx.commands.jobs",
    "hsx.commands.samples",
    "hsx.commands.cancel",
    "hsx.commands.retry",
    "hsx.commands.delete",
    "hsx.commands.manifest",
    "hsx.commands.download",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hsx",
        description="Extract a language model's hidden states, sample by sample, from an SGLang-style server.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(name)
        cmd = sub.add_parser(
            module.NAME,
            help=module.HELP,
            description=module.DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(cmd)
        cmd.set_defaults(handler=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

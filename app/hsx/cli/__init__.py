"""The `hsx` command line: one subcommand per module listed in COMMANDS.

Each module provides NAME, HELP, DESCRIPTION, add_arguments(parser) and main(args) -> int, and
imports anything heavy (torch, transformers) inside main so that `--help` stays fast and works
where neither is installed; one that needs an optional extra names it as EXTRA (hsx.cli.extras).
The client commands, which talk to a running service through the SDK, live in hsx.cli.client.
"""

from __future__ import annotations

import argparse
import importlib

from hsx.cli.extras import run

COMMANDS = [
    "hsx.cli.serve",
    "hsx.cli.worker",
    "hsx.cli.reference_server",
    "hsx.cli.demo",
    "hsx.cli.export",
    "hsx.cli.verify",
    "hsx.cli.client.submit",
    "hsx.cli.client.status",
    "hsx.cli.client.jobs",
    "hsx.cli.client.samples",
    "hsx.cli.client.cancel",
    "hsx.cli.client.retry",
    "hsx.cli.client.delete",
    "hsx.cli.client.manifest",
    "hsx.cli.client.download",
    "hsx.cli.client.follow",
    "hsx.cli.client.workers",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hsx",
        description=(
            "Extract a language model's hidden states, sample by sample, from SGLang (the hsx-sglang plugin's "
            "dumps or its answers) or vLLM (hsx's connector, or vLLM's own ExampleHiddenStatesConnector)."
        ),
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
        cmd.set_defaults(handler=module.main, extra=getattr(module, "EXTRA", None))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(args.handler, args, f"hsx {args.command}", args.extra)

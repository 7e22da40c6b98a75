"""The `hsx` command line: the service, the reference model server and the demo."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hsx",
        description="Extract a language model's hidden states, sample by sample, from an SGLang-style server.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from app import demo, serve
    from app.reference import cli as reference_cli

    srv = sub.add_parser("serve", help="run the extraction service (API + dump-root writer)",
                         description=serve.DESCRIPTION)
    serve.add_arguments(srv)
    srv.set_defaults(handler=serve.main)

    ref = sub.add_parser(
        "reference-server",
        help="run the SGLang-compatible reference model server that writes hidden-state dumps",
        description=reference_cli.DESCRIPTION,
    )
    reference_cli.add_arguments(ref)
    ref.set_defaults(handler=reference_cli.main)
    dem = sub.add_parser("demo", help="run a small job end to end on this machine (reference server + service)",
                         description=demo.DESCRIPTION)
    demo.add_arguments(dem)
    dem.set_defaults(handler=demo.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

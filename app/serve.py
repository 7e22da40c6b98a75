"""`hsx serve`: settings from flags and HSX_* variables, the dump-root lock, then uvicorn."""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn
from hsx.config import Settings

NAME = "serve"
HELP = "run the extraction service (API + dump-root writer)"
DESCRIPTION = (
    "Run the extraction service: the HTTP API plus the single writer for one dump root. "
    "Every flag can also be set by an environment variable named HSX_<FLAG> (e.g. HSX_DATABASE_URL)."
)

FLAGS = {
    "backend_url": (str, "base URL of the SGLang-style model server"),
    "dump_root": (str, "the directory the model server writes dumps to; this service must own it"),
    "staging_dir": (str, "where validated dumps wait for their shard (same file system as the dump root)"),
    "output_root": (str, "shards and manifest.json go under OUTPUT_ROOT/<job id>/"),
    "input_root": (str, "jobs may name JSONL input files under this folder only"),
    "database_url": (str, "sqlite:///path.db (default) or postgresql://user@host/db"),
    "host": (str, "address to listen on"),
    "port": (int, "port to listen on"),
    "shard_max_bytes": (
        int,
        "a job's shard is written once its staged samples reach this size, and as soon "
        "as the job has no queued sample left",
    ),
    "shard_max_wait_s": (float, "staged samples wait at most this long for their shard"),
    "max_attempts": (int, "attempts per sample before it is failed"),
    "dump_wait_s": (float, "how long to wait for a dump's done marker after the server replied"),
    "request_timeout_s": (float, "HTTP timeout for one /generate request"),
    "name_by": (str, "dump naming: auto (ask the server), counter or rid"),
    "max_json_bytes": (int, "largest application/json request body"),
    "max_ndjson_bytes": (int, "largest streamed application/x-ndjson job body"),
    "max_in_flight": (int, "rid mode: requests in flight at once (counter-named dumps always take one at a time)"),
    "disk_check": (str, "refuse, warn or off: what to do when a new job would not fit on the output volume"),
    "api_tokens": (str, "comma-separated bearer tokens (TOKEN or TOKEN:read); unset: no authentication"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Settings.model_fields
    for name, (kind, text) in FLAGS.items():
        default = defaults[name].default
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=kind,
            default=None,
            help=f"{text} (env HSX_{name.upper()}; default {default})",
        )
    parser.add_argument(
        "--no-writer", action="store_true", help="serve the API only; another process runs the writer for the dump root"
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def settings_from_args(args: argparse.Namespace) -> Settings:
    given = {name: getattr(args, name) for name in FLAGS if getattr(args, name, None) is not None}
    if getattr(args, "no_writer", False):
        given["run_writer"] = False
    return Settings(**given)


def main(args: argparse.Namespace) -> int:
    from hsx.api.app import create_app
    from hsx.backends.dumps import DumpRootBusy
    from hsx.db.engine import make_engine, session_factory
    from hsx.extraction import Writer

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings_from_args(args)
    writer = None
    if settings.run_writer:
        writer = Writer(settings, session_factory(make_engine(settings.database_url)))
        try:
            writer.acquire()
        except DumpRootBusy as exc:
            print(f"hsx serve: {exc}", file=sys.stderr)
            return 2
    app = create_app(settings, writer)
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=args.log_level)
    return 0

"""`hsx worker`: the writer for one dump root without the HTTP API, for a node beside its model server.

Several workers (and `hsx serve --no-writer` for the API) share one Postgres queue; each holds a
lease (--lease-s) and the work of one that stops renewing it goes back to the queue."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from hsx.cli import serve
from pydantic import ValidationError

NAME = "worker"
HELP = "run the dump-root writer alone (no HTTP API), one per model server"
DESCRIPTION = (
    "Run the writer for one dump root: take samples from the database's queue, extract them from the "
    "model server, write shards. The same flags as `hsx serve` for the model server, the dump root, the "
    "output and the database (the API's flags are not taken); every flag can also be set by an "
    "environment variable named HSX_<FLAG>. Runs until SIGTERM or SIGINT."
)

# What only the HTTP API uses.
API_SETTINGS = {
    "host",
    "port",
    "input_root",
    "max_json_bytes",
    "max_ndjson_bytes",
    "api_tokens",
    "disk_check",
    "run_writer",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve.add_arguments(parser, exclude=API_SETTINGS)


def main(args: argparse.Namespace) -> int:
    from hsx.backends.dumps import DumpRootBusy
    from hsx.db.engine import make_engine, session_factory, upgrade
    from hsx.extraction import Writer, writer_engine
    from hsx.extraction.output_root import shared_output_root
    from hsx.storage.output_root import OutputRootMismatch

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = serve.settings_from_args(args)
    except ValidationError as exc:
        for line in serve.setting_errors(exc):
            print(f"hsx worker: {line}", file=sys.stderr)
        return 2
    setup = make_engine(settings.database_url)
    try:
        upgrade(setup)
        with session_factory(setup).begin() as session:
            shared_output_root(session, settings.output_root, mark=True)
    except OutputRootMismatch as exc:
        print(f"hsx worker: {exc}", file=sys.stderr)
        return 2
    finally:
        setup.dispose()
    engine = writer_engine(settings)
    writer = Writer(settings, session_factory(engine))
    try:
        writer.acquire()
    except DumpRootBusy as exc:
        print(f"hsx worker: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    writer.start_thread()
    logging.getLogger("hsx.writer").info("worker %s running against %s", writer.identity, settings.backend_url)
    stop.wait()
    writer.stop()
    engine.dispose()
    return 0

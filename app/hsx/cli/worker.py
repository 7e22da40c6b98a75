"""`hsx worker`: the writer for one dump root without the HTTP API, for a node beside its model server.

Several workers (and `hsx serve --no-writer` for the API) share one Postgres queue; each holds a
lease (--lease-s) and the work of one that stops renewing it goes back to the queue. Each also
completes cancels (hsx.service.cancelling), so that a job cancelled through an API that has stopped
since still ends. With --metrics-port it serves its writer's /metrics and /healthz
(hsx.extraction.exposition)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from hsx.cli import serve

NAME = "worker"
HELP = "run the dump-root writer alone (no HTTP API), one per model server"
DESCRIPTION = (
    "Run the writer for one dump root: take samples from the database's queue, extract them from the "
    "model server, write shards. The same flags as `hsx serve` for the model server, the dump root, the "
    "output and the database (the API's flags are not taken); every flag can also be set by an "
    "environment variable named HSX_<FLAG>. With --metrics-port it serves GET /metrics (Prometheus) and GET "
    "/healthz (200 while its writer is ready or waiting, else 503) on that port. Runs until SIGTERM or SIGINT."
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
    serve.add_settings(parser, exclude=API_SETTINGS, access_log=False)  # no HTTP API, no access log


def main(args: argparse.Namespace) -> int:
    settings = serve.prepare(args, "hsx worker")
    if isinstance(settings, int):
        return settings
    writer = serve.acquired_writer(settings, "hsx worker")
    if writer is None:
        return 2
    from hsx.db.engine import make_engine, session_factory
    from hsx.extraction.exposition import MetricsServer
    from hsx.service.cancelling import CancelSweeper

    exposition = None
    if settings.metrics_port is not None:
        try:
            exposition = MetricsServer(writer, settings.metrics_host, settings.metrics_port)
        except OSError as exc:
            where = f"{settings.metrics_host}:{settings.metrics_port}"
            print(f"hsx worker: --metrics-port: cannot listen on {where}: {exc.strerror or exc}", file=sys.stderr)
            writer.root.release()
            return 2
        exposition.start()

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    engine = make_engine(settings.database_url)
    cancels = CancelSweeper(session_factory(engine), settings.output_root, settings.cancel_batch)
    cancels.start()
    writer.start_thread()
    logging.getLogger("hsx.writer").info("worker %s running against %s", writer.identity, settings.backend_url)
    stop.wait()
    writer.stop()
    cancels.stop()
    if exposition is not None:
        exposition.stop()
    engine.dispose()
    return 0

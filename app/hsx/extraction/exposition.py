"""What a writer says about itself over HTTP: its Prometheus lines (its state and its counters) and its
health. The API's /metrics and /healthz carry them for the writer of `hsx serve`; an `hsx worker`, which
has no API, serves them on --metrics-port from a small HTTP server on a thread of its own, so that a
scrape or a probe never waits for the writer's work."""

from __future__ import annotations

import json
import logging
import threading
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from hsx.extraction.metrics import label
from hsx.matching import layer_sets, serves_default

if TYPE_CHECKING:
    from hsx.extraction.preparer import PreparerHealth
    from hsx.extraction.writer import Writer

log = logging.getLogger("hsx.writer")

WRITER_STATES = ("starting", "ready", "waiting", "refusing", "stopped")
PREPARER_STATES = ("idle", "preparing", "failing")
# A writer waiting for its model server or for room on the output disk is working as it should: it goes
# on by itself. Starting, refusing (a server it must not extract from) or stopped is not.
HEALTHY_STATES = ("ready", "waiting")
METRICS_MEDIA_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def writer_lines(writer: Writer, tokens_per_s: float | None = None) -> list[str]:
    """The writer's Prometheus lines: whether it is ready, its state, and its counters; `tokens_per_s`
    its rate as the caller read it for the rest of its answer."""
    identity, state = label(writer.identity), writer.status.state
    lines = [
        "# HELP hsx_writer_ready Whether this process's dump-root writer can extract now.",
        "# TYPE hsx_writer_ready gauge",
        f'hsx_writer_ready{{identity="{identity}"}} {int(state == "ready")}',
        "# HELP hsx_writer_state The writer's state: 1 for the one it is in.",
        "# TYPE hsx_writer_state gauge",
    ]
    lines += [f'hsx_writer_state{{identity="{identity}",state="{s}"}} {int(s == state)}' for s in WRITER_STATES]
    return lines + preparer_lines(identity, writer.preparer) + writer.metrics.render(tokens_per_s)


def preparer_lines(identity: str, health: PreparerHealth) -> list[str]:
    """The preparer's lines: its state, conversations it prepared, and steps that failed."""
    lines = [
        "# HELP hsx_preparer_state The writer's conversation preparer: 1 for the state it is in (failing: its "
        "last step raised, see /healthz for why).",
        "# TYPE hsx_preparer_state gauge",
    ]
    lines += [
        f'hsx_preparer_state{{identity="{identity}",state="{s}"}} {int(s == health.state)}' for s in PREPARER_STATES
    ]
    return [
        *lines,
        "# HELP hsx_preparer_samples_total Conversation samples this writer's preparer moved on (queued, skipped "
        "or failed) since it started.",
        "# TYPE hsx_preparer_samples_total counter",
        f'hsx_preparer_samples_total{{identity="{identity}"}} {health.prepared}',
        "# HELP hsx_preparer_failures_total Preparer steps that raised since the writer started.",
        "# TYPE hsx_preparer_failures_total counter",
        f'hsx_preparer_failures_total{{identity="{identity}"}} {health.failures}',
    ]


def preparer_health(health: PreparerHealth) -> dict[str, Any]:
    return {
        "state": health.state,
        "reason": health.reason,
        "since": datetime.fromtimestamp(health.since, timezone.utc).isoformat(),
        "prepared": health.prepared,
    }


def writer_health(writer: Writer) -> tuple[int, dict[str, Any]]:
    """(HTTP status, body) of the writer's health: 200 while it is ready or waiting and its preparer is not
    failing, else 503."""
    status = writer.status
    healthy = status.state in HEALTHY_STATES and writer.preparer.state != "failing"
    body = {
        "status": "ok" if healthy else "unavailable",
        "writer": {
            "identity": writer.identity,
            "state": status.state,
            "reason": status.reason,
            "since": datetime.fromtimestamp(status.since, timezone.utc).isoformat(),
            "tokens_per_s": writer.metrics.tokens_per_second(),
            "preparer": preparer_health(writer.preparer),
            # Which jobs it can take, beside whether it is healthy: a ready writer of other layers than the
            # default set is healthy, and jobs that do not name their layers still wait for another.
            "layer_sets": layer_sets(status.server),
            "serves_default": serves_default(status.server),
        },
    }
    return (200 if healthy else 503), body


class MetricsServer:
    """GET (and HEAD) /metrics and /healthz of one writer, on `host`:`port`; anything else is a 404. No
    token is asked for: bind it where only the monitoring reaches it. Binding fails (OSError) at once,
    so that a port in use stops the worker before it starts."""

    def __init__(self, writer: Writer, host: str, port: int):
        self.server = ThreadingHTTPServer((host, port), _handler(writer))
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, name="hsx-metrics", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.server.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        self._thread.start()
        log.info("metrics and health on http://%s:%d/metrics and /healthz", *self.address)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _handler(writer: Writer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "hsx-worker"

        def do_GET(self) -> None:
            self._answer(body=True)

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def _answer(self, *, body: bool) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                status, media, data = 200, METRICS_MEDIA_TYPE, "\n".join(writer_lines(writer)) + "\n"
            elif path == "/healthz":
                status, health = writer_health(writer)
                media, data = "application/json", json.dumps(health)
            else:
                status, media = 404, "application/problem+json"
                data = json.dumps(
                    {
                        "type": "/problems/not-found",
                        "title": "Not Found",
                        "status": 404,
                        "detail": "this port serves GET /metrics and GET /healthz only",
                    }
                )
            payload = data.encode()
            self.send_response(status)
            self.send_header("Content-Type", media)
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            if body:
                self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("metrics port: " + format, *args)

    return Handler

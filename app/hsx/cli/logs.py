"""How `hsx serve` and `hsx worker` log: to stderr, as text lines or as one JSON object per line.

What hsx itself logs is kept at the level asked for; what would put a line in the log for every
request is not: the API's access log (every status poll) is off unless --access-log, and httpx's
line for every request to the model server shows only with --log-level debug.
"""

from __future__ import annotations

import argparse
import json
import logging
from datetime import datetime, timezone

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# httpx logs each request it sends at INFO, httpcore each step of it at DEBUG.
PER_REQUEST_LOGGERS = ("httpx", "httpcore")


class JsonLines(logging.Formatter):
    """One JSON object per record, for log collectors: time (UTC, ISO 8601), level, logger, message,
    and the traceback as `exception` when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def add_arguments(parser: argparse.ArgumentParser, *, access_log: bool) -> None:
    parser.add_argument(
        "--log-level",
        default="info",
        choices=LEVELS,
        help="debug also logs every request sent to the model server (default: %(default)s)",
    )
    parser.add_argument(
        "--log-format",
        default="text",
        choices=FORMATS,
        help="text lines, or json: one object per line with time, level, logger and message (default: %(default)s)",
    )
    if access_log:
        parser.add_argument("--access-log", action="store_true", help="log every HTTP request the API answers")


def configure(level: str, fmt: str) -> None:
    """Every logger's records, uvicorn's included (run with log_config=None), through one handler."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLines() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    quiet = logging.NOTSET if level == "debug" else logging.WARNING
    for name in PER_REQUEST_LOGGERS:
        logging.getLogger(name).setLevel(quiet)

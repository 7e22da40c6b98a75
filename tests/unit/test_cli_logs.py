"""--log-format json: one JSON object per record, whatever the message holds."""

from __future__ import annotations

import json
import logging
import sys

from hsx.cli.logs import JsonLines


def record(message: str, *args, exc_info=None) -> logging.LogRecord:
    return logging.LogRecord("hsx.writer", logging.WARNING, __file__, 1, message, args, exc_info)


def test_a_record_is_one_line_of_json():
    line = JsonLines().format(record("writer %s: %s", "refusing", 'two\nlines, "quoted", ünï'))
    assert "\n" not in line
    entry = json.loads(line)
    assert entry["level"] == "WARNING" and entry["logger"] == "hsx.writer"
    assert entry["message"] == 'writer refusing: two\nlines, "quoted", ünï'
    assert entry["time"].endswith("+00:00")


def test_a_traceback_goes_with_its_record():
    try:
        raise ValueError("bad dump")
    except ValueError:
        line = JsonLines().format(record("writing a shard failed", exc_info=sys.exc_info()))
    entry = json.loads(line)
    assert entry["message"] == "writing a shard failed" and "ValueError: bad dump" in entry["exception"]

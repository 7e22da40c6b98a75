"""`hsx serve` as an operator runs it: the folders it makes for itself, and what it logs."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.support.procs import Process, free_port, hsx_command


def serve_args(tmp: Path, *extra: str, port: int | None = None) -> list[str]:
    """`hsx serve` on SQLite in `tmp`."""
    return hsx_command() + [
        "serve",
        "--database-url",
        f"sqlite:///{tmp / 'hsx.db'}",
        "--output-root",
        str(tmp / "output"),
        "--port",
        str(port or free_port()),
        *extra,
    ]


def test_serve_creates_its_input_root_and_names_it_when_a_file_is_missing(tmp_path):
    root = tmp_path / "srv" / "hsx" / "input"
    port = free_port()
    proc = Process(serve_args(tmp_path, "--no-writer", "--input-root", str(root), port=port), tmp_path / "serve.log")
    try:
        url = f"http://127.0.0.1:{port}"
        proc.wait_http(url + "/healthz")
        assert root.is_dir()
        resp = httpx.post(url + "/v1/jobs", json={"input_path": "x.jsonl"}, timeout=30)
        assert resp.status_code == 422, resp.text
        assert resp.json()["errors"][0]["message"] == f"no file 'x.jsonl' under the input root {root}"
    finally:
        proc.stop()


def test_serve_says_in_one_line_when_it_cannot_create_its_input_root(tmp_path):
    (tmp_path / "file").write_text("")
    root = tmp_path / "file" / "input"
    proc = subprocess.run(
        serve_args(tmp_path, "--no-writer", "--input-root", str(root)), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    # The last line, after the migration's log: the database is brought up to date first.
    assert proc.stderr.splitlines()[-1] == f"hsx serve: cannot create the input root {root}: Not a directory"


class InfoOnly(BaseHTTPRequestHandler):
    """A model server that answers {} to every GET (health, model and server info) and nothing else:
    hsx asks it what it serves, then refuses it, which is all these tests need of one."""

    def do_GET(self) -> None:
        self.server.gets += 1  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def model_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), InfoOnly)
    server.gets = 0  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def served_log(tmp: Path, model_server, *flags: str) -> str:
    """The log of `hsx serve` (with its writer, against `model_server`) that has asked the model server
    what it serves and answered a few status polls, once it has stopped."""
    port = free_port()
    backend = f"http://127.0.0.1:{model_server.server_address[1]}"
    where = ["--input-root", str(tmp / "input"), "--dump-root", str(tmp / "dumps"), "--backend-url", backend]
    proc = Process(serve_args(tmp, *where, *flags, port=port), tmp / "serve.log")
    try:
        url = f"http://127.0.0.1:{port}"
        proc.wait_http(url + "/healthz")
        for _ in range(3):
            assert httpx.get(url + "/v1/jobs", timeout=30).status_code == 200
        deadline = time.monotonic() + 60
        while model_server.gets < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert model_server.gets >= 2, proc.log()
    finally:
        proc.stop()
    return proc.log()


def test_status_polls_and_model_server_requests_are_not_logged_by_default(tmp_path, model_server):
    log = served_log(tmp_path, model_server)
    assert "Uvicorn running on" in log and "hsx.writer" in log, log
    assert "GET /v1/jobs" not in log and "GET /healthz" not in log, "no access log"
    assert "HTTP Request" not in log and "/model_info" not in log, "no line per request to the model server"


def test_access_log_and_debug_bring_them_back(tmp_path, model_server):
    log = served_log(tmp_path, model_server, "--access-log", "--log-level", "debug")
    assert '"GET /v1/jobs HTTP/1.1" 200' in log, log
    assert "HTTP Request: GET http://127.0.0.1:" in log and "/model_info" in log, log


def test_json_log_format_is_one_object_per_line(tmp_path, model_server):
    log = served_log(tmp_path, model_server, "--log-format", "json", "--access-log")
    entries = [json.loads(line) for line in log.splitlines()]
    assert all(set(e) == {"time", "level", "logger", "message"} for e in entries), entries
    assert all(datetime.fromisoformat(e["time"]).utcoffset().total_seconds() == 0 for e in entries)
    loggers = {e["logger"] for e in entries}
    assert {"alembic.runtime.migration", "uvicorn.error", "uvicorn.access", "hsx.writer"} <= loggers, loggers
    refused = next(
        e for e in entries if e["logger"] == "hsx.writer" and e["level"] == "WARNING" and "refusing" in e["message"]
    )
    assert "refusing" in refused["message"] and "\n" in refused["message"], "a message of several lines stays one"

"""A client that disconnects in the middle of its job's body: nothing is stored, the service logs one
line (no traceback), and answers the next client at once."""

from __future__ import annotations

import socket
import time

import pytest

from tests.support.stack import start_service


@pytest.mark.parametrize(
    "media, start", [("application/json", b'{"samples": ['), ("application/x-ndjson", b'{"input_ids": [1, 2]}\n')]
)
def test_a_client_that_goes_away_mid_body_is_a_line_in_the_log(tmp_path, database_url, media, start):
    svc = start_service(tmp_path, database_url)
    try:
        host, port = svc.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as s:
            head = f"POST /v1/jobs HTTP/1.1\r\nHost: {host}\r\nContent-Type: {media}\r\nContent-Length: 9000000\r\n\r\n"
            s.sendall(head.encode() + start)
            time.sleep(0.5)
        deadline = time.monotonic() + 10
        while "disconnected before its request body was whole" not in svc.proc.log():
            assert time.monotonic() < deadline, svc.proc.log()[-2000:]
            time.sleep(0.1)
        assert svc.get("/v1/jobs").json()["data"] == []
        assert "Traceback" not in svc.proc.log() and "ERROR" not in svc.proc.log(), svc.proc.log()[-3000:]
    finally:
        svc.stop()

"""An HTTP proxy in front of the service that corrupts shard downloads: the first `flips` answers to
`GET .../shards/<name>` arrive with one byte of their body flipped, as a bad link or a broken middlebox
would deliver them. Everything else passes through unchanged. A real network does not corrupt bytes on
demand; this is the fault the stream's sha256 check must catch."""

from __future__ import annotations

import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from tests.support.procs import free_port

SHARD_DOWNLOAD = re.compile(r"^/v1/jobs/[^/]+/shards/shard-[^/?]+$")
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding"}


class FlippingProxy:
    def __init__(self, upstream: str, *, flips: int):
        self.upstream = upstream.rstrip("/")
        self.remaining = flips
        self.flipped = 0
        self._lock = threading.Lock()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> FlippingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _take_flip(self) -> bool:
        with self._lock:
            if self.remaining <= 0:
                return False
            self.remaining -= 1
            self.flipped += 1
            return True

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP | {"host"}}
                with httpx.Client(timeout=120) as client:
                    resp = client.request(self.command, proxy.upstream + self.path, headers=headers, content=body)
                data = bytearray(resp.content)
                path = self.path.split("?", 1)[0]
                download = self.command == "GET" and resp.status_code in (200, 206) and SHARD_DOWNLOAD.match(path)
                if download and data and proxy._take_flip():
                    data[len(data) // 2] ^= 0x40
                self.send_response(resp.status_code)
                for key, value in resp.headers.items():
                    if key.lower() not in HOP_BY_HOP:
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(bytes(data))

            do_GET = do_POST = do_DELETE = do_HEAD = _forward

        return Handler

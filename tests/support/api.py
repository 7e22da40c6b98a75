"""Checks on a running service's answers and on what it stored, and requests httpx will not send."""

from __future__ import annotations

import socket
from pathlib import Path

from sqlalchemy import func, select

from hsx.config import Settings
from hsx.db.engine import make_engine, session_factory, upgrade
from hsx.db.models import JobRow, SampleRow
from hsx.extraction.output_root import shared_output_root


def problem(resp, status: int) -> dict:
    """The problem+json body of an error answer with this status."""
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/problem+json")
    body = resp.json()
    assert body["status"] == status and body["title"] and body["detail"] and body["type"]
    return body


def stored_rows(database) -> tuple[int, int]:
    """How many jobs and samples the database holds: a URL, or a service (its database)."""
    engine = make_engine(getattr(database, "database_url", database))
    try:
        with engine.connect() as conn:
            return (
                conn.execute(select(func.count()).select_from(JobRow)).scalar_one(),
                conn.execute(select(func.count()).select_from(SampleRow)).scalar_one(),
            )
    finally:
        engine.dispose()


class RawUpload:
    """A POST written by hand on its own connection: the headers, then the body in as many parts and as
    slowly as the test likes, so a test can act while the service holds a request half received."""

    def __init__(self, url: str, path: str, headers: dict[str, str]):
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        head = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", *(f"{k}: {v}" for k, v in headers.items())]
        self.sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def response(self) -> tuple[int, dict[str, str], bytes]:
        """Status, headers (lower-case names) and body of the answer (read to Content-Length)."""
        data = b""
        while b"\r\n\r\n" not in data:
            part = self.sock.recv(65536)
            assert part, f"connection closed before an answer: {data!r}"
            data += part
        head, _, body = data.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        while len(body) < int(headers.get("content-length", 0)):
            part = self.sock.recv(65536)
            assert part, "connection closed in the answer's body"
            body += part
        return int(status_line.split()[1]), headers, body

    def close(self) -> None:
        self.sock.close()


def api_only_settings(tmp: Path) -> Settings:
    """What `hsx serve --no-writer` would run with in `tmp`: a migrated SQLite database and a marked output
    root; the model server's address answers nothing, so only the model-independent checks apply."""
    (tmp / "input").mkdir(exist_ok=True)
    settings = Settings(
        database_url=f"sqlite:///{tmp / 'hsx.db'}",
        output_root=tmp / "output",
        input_root=tmp / "input",
        dump_root=tmp / "dumps",
        backend_url="http://127.0.0.1:9",
        run_writer=False,
        api_tokens="",
    )
    migrated(settings)
    return settings


def migrated(settings: Settings) -> None:
    """The settings' database migrated, and its output root marked as that database's."""
    engine = make_engine(settings.database_url)
    upgrade(engine)
    with session_factory(engine).begin() as session:
        shared_output_root(session, settings.output_root, mark=True)
    engine.dispose()

"""The service's database connections killed under a keep-alive client (Postgres's
pg_terminate_backend every 0.3 s): every answer is 200 or a 503 problem, and the client's one
connection stays usable all along; the service logs no traceback for it."""

from __future__ import annotations

import threading
import time

import httpx
import psycopg
import pytest

from tests.conftest import PG_ADMIN
from tests.support.stack import start_service

pytestmark = pytest.mark.postgres


class Killer(threading.Thread):
    """Terminates every connection to one database but its own, every `period` seconds."""

    def __init__(self, database: str, period: float = 0.3):
        super().__init__(daemon=True)
        self.database, self.period, self.stop, self.killed = database, period, threading.Event(), 0

    def run(self) -> None:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            while not self.stop.wait(self.period):
                rows = conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE datname = %s AND pid <> pg_backend_pid()",
                    (self.database,),
                ).fetchall()
                self.killed += len(rows)


def test_killed_database_connections_answer_503_and_keep_the_http_connection(tmp_path, postgres_url):
    svc = start_service(tmp_path, postgres_url)
    job_id = svc.post_job({"samples": [{"id": "a", "input_ids": [1, 2, 3]}]}).json()["id"]
    killer = Killer(postgres_url.rsplit("/", 1)[1])
    statuses: dict[int, int] = {}
    failures: list[str] = []
    paths = ["/v1/jobs", f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/samples", "/healthz"]
    try:
        killer.start()
        with httpx.Client(base_url=svc.url, timeout=30, limits=httpx.Limits(max_keepalive_connections=1)) as c:
            deadline = time.monotonic() + 12
            while time.monotonic() < deadline:
                for path in paths:
                    try:
                        r = c.get(path)
                    except httpx.TransportError as exc:
                        failures.append(f"{path}: {type(exc).__name__}")
                        continue
                    statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                    if r.status_code == 503:
                        assert r.headers["content-type"] == "application/problem+json", r.text
    finally:
        killer.stop.set()
        killer.join()
        log = svc.proc.log()
        svc.stop()
    assert killer.killed > 10, "the test killed connections"
    assert failures == [], (failures[:10], statuses)
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.get(200, 0) > 0
    assert "Traceback" not in log and "response already started" not in log, log[-3000:]

"""Cancel benchmark: a job of a million queued samples, cancelled, on SQLite and on Postgres.

    python -m benchmarks.bench_cancel                         # 1,000,000 samples, both databases
    python -m benchmarks.bench_cancel --samples 200000 --databases sqlite

For each database: the job's rows are inserted directly (repository.JobBuilder, COPY on Postgres), an
API-only service (`hsx serve --no-writer`) is started on it, and the benchmark times the cancel request
(it answers with the job `cancelling`) and then the time until the job is `cancelled`, every queued
sample moved by the service's background batches (--cancel-batch). Postgres runs in a fresh database
on the server at --postgres-admin, dropped afterwards.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import psycopg

from hsx.db import repository as repo
from hsx.db.engine import make_engine, session_factory, upgrade
from hsx.states import JobState
from tests.support.stack import start_service

INSERT_BATCH = 20_000


def queued_job(database_url: str, samples: int, tokens: int) -> str:
    """A job with `samples` queued samples of `tokens` tokens each; its id."""
    engine = make_engine(database_url)
    upgrade(engine)
    ids = np.arange(1, tokens + 1, dtype="<i4").tobytes()
    with session_factory(engine).begin() as s:
        builder = repo.JobBuilder(s, name="bench-cancel", layers=None)
        for start in range(0, samples, INSERT_BATCH):
            builder.add(
                [repo.NewSample(f"s{i}", ids, None, tokens) for i in range(start, min(samples, start + INSERT_BATCH))]
            )
        job_id = builder.finish().id
    engine.dispose()
    return job_id


def measure(database_url: str, args: argparse.Namespace) -> tuple[float, float, float, dict]:
    """(insert s, cancel request s, until cancelled s, the final job)."""
    with tempfile.TemporaryDirectory(prefix="hsx-cancel-") as tmp:
        t = time.perf_counter()
        job_id = queued_job(database_url, args.samples, args.tokens)
        inserted = time.perf_counter() - t
        svc = start_service(Path(tmp), database_url, extra=["--no-writer", "--cancel-batch", str(args.batch)])
        try:
            with httpx.Client(timeout=600) as c:
                t = time.perf_counter()
                resp = c.post(f"{svc.url}/v1/jobs/{job_id}/cancel")
                answered = time.perf_counter()
                assert resp.status_code == 200, resp.text
                assert resp.json()["state"] == JobState.CANCELLING, resp.text
                while True:
                    job = c.get(f"{svc.url}/v1/jobs/{job_id}").json()
                    if job["state"] in (JobState.CANCELLED, JobState.FAILED, JobState.SUCCEEDED):
                        break
                    time.sleep(0.05)
                finished = time.perf_counter()
        finally:
            svc.stop()
    assert job["state"] == JobState.CANCELLED and job["counts"]["cancelled"] == args.samples, job
    return inserted, answered - t, finished - t, job


def fresh_postgres(admin_url: str) -> tuple[str, str]:
    name = f"hsx_bench_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"{admin_url.rsplit('/', 1)[0]}/{name}", name


def drop_postgres(admin_url: str, name: str) -> None:
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--tokens", type=int, default=16, help="tokens per sample")
    parser.add_argument("--batch", type=int, default=10_000, help="the service's --cancel-batch")
    parser.add_argument("--databases", default="sqlite,postgres", help="comma-separated: sqlite, postgres")
    parser.add_argument("--postgres-admin", default="postgresql://postgres@127.0.0.1:5432/test")
    args = parser.parse_args(argv)
    print(f"{args.samples:,} queued samples of {args.tokens} tokens, cancelled in batches of {args.batch:,}")
    for database in args.databases.split(","):
        if database == "sqlite":
            with tempfile.TemporaryDirectory(prefix="hsx-cancel-db-") as folder:
                figures = measure(f"sqlite:///{folder}/hsx.db", args)
        else:
            url, name = fresh_postgres(args.postgres_admin)
            try:
                figures = measure(url, args)
            finally:
                drop_postgres(args.postgres_admin, name)
        inserted, answered, finished, _ = figures
        print(
            f"  {database:<8} cancel request {answered * 1000:7.1f} ms   cancelled after {finished:6.1f} s "
            f"({args.samples / finished:,.0f} samples/s)   (rows inserted in {inserted:.1f} s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

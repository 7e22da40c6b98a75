"""No query the service runs on a hot path scans the samples table: every one is planned through an
index, proven by EXPLAIN on Postgres against a job of tens of thousands of samples."""

from __future__ import annotations

import numpy as np
import pytest
from sqlalchemy import event, text

from hsx.db import repository as repo
from hsx.db.engine import make_engine, session_factory, upgrade
from hsx.manifest import build_manifest
from hsx.matching import Serves

pytestmark = pytest.mark.postgres
N = 30_000


def test_hot_queries_use_indexes(postgres_url):
    engine = make_engine(postgres_url)
    upgrade(engine)
    sessions = session_factory(engine)
    ids = np.arange(1, 9, dtype="<i4").tobytes()
    with sessions.begin() as s:
        builder = repo.JobBuilder(s, name="big", layers=None)
        for start in range(0, N, 5000):
            builder.add([repo.NewSample(f"s{i}", ids, None, 8) for i in range(start, start + 5000)])
        job = builder.finish()
        other = repo.create_job(s, name="small", layers=None, samples=[repo.NewSample("x", ids, None, 8)])
    with sessions.begin() as s:
        for _ in range(3):
            c = repo.claim_next(s, "w")
            repo.mark_staged(
                s, c, writer="w", staged_path="/nowhere", observed_tokens=8, dump_key="k", boot_id="b", identity="ids"
            )
    with engine.connect() as conn:
        conn.execute(text("ANALYZE"))
        conn.commit()

    statements: list[tuple[str, object]] = []

    def record(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith(("SELECT", "UPDATE", "WITH")) and "pg_" not in statement:
            statements.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", record)
    with sessions.begin() as s:
        claimed = repo.claim_next(s, "w2", Serves("2,4", "0" * 32))
        repo.record_failed_attempt(s, claimed, reason="x", max_attempts=3)
        repo.get_job(s, job.id)
        page = repo.list_samples(s, job.id, state="queued", after_idx=100, limit=100)
        repo.get_sample(s, job.id, page[-1].sample_id)
        repo.staged_samples(s, "w", job.id)
        repo.waiting(s)
        repo.finish_job_if_done(s, other.id)
        next(repo.iter_stored_samples(s, job.id, batch=1000), None)
        build_manifest(s, repo.get_job(s, other.id))
        repo.cancel_job(s, job.id)
        repo.cancelling_jobs(s)
        assert repo.cancel_queued(s, job.id, 1000) == 1000
        s.rollback()
    event.remove(engine, "before_cursor_execute", record)
    assert len(statements) >= 10

    plans = {}
    with engine.connect() as conn:
        raw = conn.connection.dbapi_connection
        for statement, params in statements:
            with raw.cursor() as cur:
                cur.execute("EXPLAIN " + statement, params)
                plans[statement] = "\n".join(row[0] for row in cur.fetchall())
        raw.rollback()
    engine.dispose()
    scans = {sql: plan for sql, plan in plans.items() if "Seq Scan on samples" in plan}
    assert not scans, "\n\n".join(f"{sql}\n{plan}" for sql, plan in scans.items())
    assert any("Index" in plan for plan in plans.values())

"""Each job's attempts counted by outcome and reason code as they end, and its queued samples tried
before, on SQLite and Postgres: after every way an attempt can end, the counters equal what grouping
the attempts table and counting the samples finds; migration 0008 counts what was stored before it."""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timezone

import numpy as np
from alembic import command
from sqlalchemy import func, select, text
from sqlalchemy.orm import Session, sessionmaker

from hsx.db import repository as repo
from hsx.db.engine import alembic_config, make_engine, session_factory, upgrade
from hsx.db.models import AttemptCountRow, AttemptRow, SampleRow

W = "host:/dump/a"


def new_samples(n: int) -> list[repo.NewSample]:
    return [repo.NewSample(f"s{i}", np.arange(1, i + 3, dtype="<i4").tobytes(), None, i + 2) for i in range(n)]


def truth(s: Session, job_id: str) -> tuple[dict[tuple[str, str], int], int]:
    """What the rows say: ended attempts by (outcome, reason code), and queued samples tried before."""
    rows = s.execute(
        select(AttemptRow.outcome, AttemptRow.reason)
        .join(SampleRow, SampleRow.pk == AttemptRow.sample_pk)
        .where(SampleRow.job_id == job_id, AttemptRow.outcome.is_not(None))
    ).all()
    requeued = s.execute(
        select(func.count()).where(SampleRow.job_id == job_id, SampleRow.state == "queued", SampleRow.tries > 0)
    ).scalar_one()
    return dict(Counter((o, repo.reason_code(r)) for o, r in rows)), requeued


def counted(s: Session, job_id: str) -> tuple[dict[tuple[str, str], int], int]:
    counts = repo.attempt_counts(s, [job_id]).get(job_id, [])
    job = repo.get_job(s, job_id)
    assert job is not None
    return {(o, r): n for o, r, n in counts}, job.n_requeued


def check(sessions: sessionmaker[Session], job_id: str) -> dict[tuple[str, str], int]:
    with sessions() as s:
        rows, counters = truth(s, job_id), counted(s, job_id)
    assert counters == rows
    return counters[0]


def stage(s: Session, c: repo.Claimed, path: str) -> None:
    repo.mark_staged(
        s, c, writer=W, staged_path=path, observed_tokens=c.num_tokens, dump_key=None, boot_id=None, identity="ids"
    )


def test_counts_follow_every_way_an_attempt_ends(sessions, tmp_path):
    with sessions.begin() as s:
        job = repo.create_job(s, name=None, layers=None, samples=new_samples(4))
    # s0: a bad dump (retry), then stored, then found NaN by the shard writer (ok becomes retry)
    with sessions.begin() as s:
        c = repo.claim_next(s, W)
        repo.record_failed_attempt(s, c, reason="no_dump: nothing appeared", max_attempts=3)
    assert check(sessions, job.id) == {("retry", "no_dump"): 1}
    with sessions.begin() as s:
        c = repo.claim_next(s, W)
        assert c.idx == 0
        stage(s, c, str(tmp_path / "s0"))
    assert check(sessions, job.id) == {("retry", "no_dump"): 1, ("ok", ""): 1}
    with sessions.begin() as s:
        repo.reject_staged(s, job.id, c.sample_pk, reason="non_finite: NaN in layer 2", max_attempts=3)
    assert check(sessions, job.id) == {("retry", "no_dump"): 1, ("retry", "non_finite"): 1}
    # s0 again, given back unspent (the server went away), and s1 failed past its budget
    with sessions.begin() as s:
        c = repo.claim_next(s, W)
        repo.release_interrupted(s, c, reason="model server unavailable: connection refused")
    with sessions.begin() as s:
        c = repo.claim_next(s, W)
        stage(s, c, str(tmp_path / "s0b"))
    for _ in range(3):
        with sessions.begin() as s:
            c = repo.claim_next(s, W)
            assert c.idx == 1
            repo.record_failed_attempt(s, c, reason="wrong_shape: [3, 63]", max_attempts=3)
    counts = check(sessions, job.id)
    assert counts[("retry", "wrong_shape")] == 2 and counts[("failed", "wrong_shape")] == 1
    assert counts[("interrupted", "model server unavailable")] == 1
    # s2 running when the writer "crashes": interrupted at recovery; s1 retried by hand
    with sessions.begin() as s:
        assert repo.claim_next(s, W).idx == 2
    with sessions.begin() as s:
        repo.recover_writer(s, W, lambda _: True, why="service stopped during the attempt")
    with sessions.begin() as s:
        assert repo.retry_job(s, job.id) == 1
    counts = check(sessions, job.id)
    assert counts[("interrupted", "service stopped during the attempt")] == 1
    with sessions() as s:
        assert counted(s, job.id)[1] == 2, "s1 and s2 wait for another attempt"
    # cancelled: no queued sample is left, none waits; deleted: nothing of its counts is left
    with sessions.begin() as s:
        repo.cancel_job(s, job.id)
        repo.cancel_queued(s, job.id, 10)
    with sessions() as s:
        assert counted(s, job.id)[1] == 0
    check(sessions, job.id)
    with sessions.begin() as s:
        for x in repo.staged_samples(s, W, job.id):
            repo.requeue_staged(s, job.id, [x.pk], "staged dump unreadable: gone")
        repo.finish_job_if_done(s, job.id)
        assert repo.delete_job(s, job.id)
    with sessions() as s:
        assert s.execute(select(func.count()).select_from(AttemptCountRow)).scalar_one() == 0


def test_a_page_of_jobs_reads_every_jobs_counts_at_once(sessions):
    ids = []
    for budget in (2, 1, 0):
        with sessions.begin() as s:
            ids.append(repo.create_job(s, name=None, layers=None, samples=new_samples(1)).id)
        for _ in range(budget):  # the job's one sample fails for good at its last attempt
            with sessions.begin() as s:
                c = repo.claim_next(s, W)
                repo.record_failed_attempt(s, c, reason="incomplete: no done", max_attempts=budget)
    with sessions() as s:
        counts = repo.attempt_counts(s, ids)
    assert counts == {
        ids[0]: [("failed", "incomplete", 1), ("retry", "incomplete", 1)],
        ids[1]: [("failed", "incomplete", 1)],
    }


def test_migration_0008_counts_the_attempts_stored_before_it(database_url):
    engine = make_engine(database_url)
    try:
        command.upgrade(alembic_config(engine), "0007")
        now = datetime.now(timezone.utc)
        with engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO jobs (id, state, created_at, num_samples, tokens_total, tokens_done, tokens_staged, "
                    "n_queued, n_running, n_staged, n_succeeded, n_failed, n_cancelled, shards_written) "
                    "VALUES ('job_old', 'running', :now, 2, 4, 0, 0, 1, 0, 0, 0, 1, 0, 0)"
                ),
                {"now": now},
            )
            for pk, state, tries in ((1, "queued", 2), (2, "failed", 3)):
                conn.execute(
                    text(
                        "INSERT INTO samples (pk, job_id, idx, sample_id, state, input_ids, num_tokens, attempts, "
                        "tries, updated_at) VALUES (:pk, 'job_old', :pk, :sid, :state, :ids, 2, :tries, :tries, :now)"
                    ),
                    {"pk": pk, "sid": f"s{pk}", "state": state, "ids": b"\0" * 8, "tries": tries, "now": now},
                )
            attempts = [
                (1, 1, "retry", "no_dump: nothing"),
                (1, 2, "interrupted", "model server unavailable: refused"),
                (2, 1, "retry", "wrong_shape: [2, 3]"),
                (2, 2, "retry", "wrong_shape: [2, 3]"),
                (2, 3, "failed", "no colon here"),
            ]
            for sample, number, outcome, reason in attempts:
                conn.execute(
                    text(
                        "INSERT INTO attempts (sample_pk, number, writer, started_at, outcome, reason) "
                        "VALUES (:s, :n, 'w', :now, :o, :r)"
                    ),
                    {"s": sample, "n": number, "now": now, "o": outcome, "r": reason},
                )
        upgrade(engine)
        with session_factory(engine)() as s:
            assert counted(s, "job_old") == (
                {
                    ("interrupted", "model server unavailable"): 1,
                    ("retry", "no_dump"): 1,
                    ("retry", "wrong_shape"): 2,
                    ("failed", "no colon here"): 1,
                },
                1,
            )
            assert counted(s, "job_old") == truth(s, "job_old")
    finally:
        engine.dispose()

"""Writers' leases on SQLite and Postgres: registering fences earlier tokens, an expired lease is
taken over (running and staged samples back to the queue, no attempt spent), and nothing is recorded
under a lease that is no longer current."""

from __future__ import annotations

import time

import numpy as np
import pytest
from sqlalchemy import update

from hsx.db import repository as repo
from hsx.db.models import WriterRow

A, B = "host:/dump/a", "host:/dump/b"


def register(sessions, identity: str, lease_s: float = 30.0) -> int:
    with sessions.begin() as s:
        return repo.register_writer(
            s, identity, lease_s=lease_s, started_at=repo.utcnow(), staged_exists=lambda _: True
        )


def job_with(sessions, n: int) -> str:
    samples = [repo.NewSample(f"s{i}", np.arange(1, 5, dtype="<i4").tobytes(), None, 4) for i in range(n)]
    with sessions.begin() as s:
        return repo.create_job(s, name=None, layers=None, samples=samples).id


def expire(sessions, identity: str) -> None:
    with sessions.begin() as s:
        s.execute(update(WriterRow).where(WriterRow.identity == identity).values(lease_expires_at=repo.utcnow()))


def test_registering_again_fences_the_earlier_token(sessions):
    first = register(sessions, A)
    second = register(sessions, A)
    assert second == first + 1
    with sessions.begin() as s:
        repo.check_lease(s, A, second)
    with pytest.raises(repo.LeaseLost), sessions.begin() as s:
        repo.check_lease(s, A, first)


def test_an_expired_lease_is_taken_over_and_its_holder_records_nothing(sessions):
    job_id = job_with(sessions, 3)
    epoch = register(sessions, A, lease_s=30)
    register(sessions, B)
    with sessions.begin() as s:
        running = repo.claim_next(s, A)
    with sessions.begin() as s:
        staged = repo.claim_next(s, A + "#1")
        assert repo.mark_staged(
            s, staged, writer=A, staged_path="/x", observed_tokens=4, dump_key=None, boot_id=None, identity="ids"
        )
    with sessions.begin() as s:
        assert repo.expire_leases(s) == [], "a live lease is never taken over"

    expire(sessions, A)
    time.sleep(0.01)
    with sessions.begin() as s:
        assert repo.expire_leases(s) == [(A, 2)]
    with sessions() as s:
        job = repo.get_job(s, job_id)
        assert (job.n_queued, job.n_running, job.n_staged) == (3, 0, 0)
        attempts = repo.sample_attempts(s, running.sample_pk)
        assert attempts[-1].outcome == "interrupted" and "lease" in attempts[-1].reason
        writer = s.get(WriterRow, A)
        assert writer.state == "lost" and writer.epoch == epoch + 1

    # The old holder wakes up: its heartbeat and every fenced transaction fail.
    with pytest.raises(repo.LeaseLost), sessions.begin() as s:
        repo.renew_lease(s, A, epoch, lease_s=30, state="ready", reason=None, server=None, stats=None)
    with pytest.raises(repo.LeaseLost), sessions.begin() as s:
        repo.check_lease(s, A, epoch)
        repo.mark_staged(
            s, running, writer=A, staged_path="/y", observed_tokens=4, dump_key=None, boot_id=None, identity="ids"
        )
    with sessions() as s:
        assert repo.get_job(s, job_id).n_staged == 0

    # B takes the samples; A registers again and holds nothing of them.
    with sessions.begin() as s:
        assert repo.claim_next(s, B) is not None
    assert register(sessions, A) == epoch + 2
    with sessions() as s:
        job = repo.get_job(s, job_id)
        assert (job.n_queued, job.n_running) == (2, 1)


def test_a_stopped_writer_is_not_taken_over_twice(sessions):
    epoch = register(sessions, A)
    with sessions.begin() as s:
        repo.report_writer_stopped(s, A, epoch)
    time.sleep(0.01)
    with sessions.begin() as s:
        assert repo.expire_leases(s) == [(A, 0)]
    with sessions.begin() as s:
        assert repo.expire_leases(s) == []

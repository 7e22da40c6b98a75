"""The repository's transitions on SQLite and Postgres: one running sample per writer, claims, retries,
outages, recovery after a crash, cancel and fail, on jobs small and large."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone

import numpy as np
import pytest
from sqlalchemy import event, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from hsx.db import repository as repo
from hsx.db.engine import make_engine, session_factory, upgrade
from hsx.db.models import SampleRow, ThroughputRow
from hsx.extraction.output_root import shared_output_root
from hsx.service.cancelling import CancelSweeper


def new_samples(n: int) -> list[repo.NewSample]:
    return [repo.NewSample(f"s{i}", np.arange(1, i + 3, dtype="<i4").tobytes(), None, i + 2) for i in range(n)]


def test_one_running_sample_per_writer(sessions):
    with sessions.begin() as s:
        job = repo.create_job(s, name=None, layers=None, samples=new_samples(3))
    with sessions.begin() as s:
        first = repo.claim_next(s, "host:/dump/a")
    assert first is not None and first.idx == 0 and first.attempt == 1
    with sessions.begin() as s:
        assert repo.claim_next(s, "host:/dump/a") is None, "a writer with a running sample claims nothing more"
    with sessions.begin() as s:
        other = repo.claim_next(s, "host:/dump/b")
    assert other is not None and other.idx == 1
    # The partial unique index refuses a second running sample for a writer, whatever the code does.
    with pytest.raises(IntegrityError), sessions.begin() as s:
        s.execute(
            update(SampleRow)
            .where(SampleRow.job_id == job.id, SampleRow.idx == 2)
            .values(state="running", writer="host:/dump/a")
        )
    with sessions() as s:
        j = repo.get_job(s, job.id)
        assert (j.n_queued, j.n_running, j.state) == (1, 2, "running")


def test_concurrent_claims_for_one_writer_take_one_sample(sessions):
    with sessions.begin() as s:
        repo.create_job(s, name=None, layers=None, samples=new_samples(8))
    results, barrier = [], threading.Barrier(6)

    def claim():
        barrier.wait()
        try:
            with sessions.begin() as s:
                results.append(repo.claim_next(s, "host:/dump/x"))
        except IntegrityError:
            results.append("refused")

    threads = [threading.Thread(target=claim) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    claimed = [r for r in results if r not in (None, "refused")]
    assert len(claimed) == 1, results


def test_failed_attempts_retry_then_fail_with_reason(sessions):
    with sessions.begin() as s:
        job = repo.create_job(s, name=None, layers=None, samples=new_samples(1))
    for attempt in (1, 2, 3):
        with sessions.begin() as s:
            c = repo.claim_next(s, "w")
            assert c.attempt == attempt
            outcome = repo.record_failed_attempt(s, c, reason=f"no_dump: try {attempt}", max_attempts=3)
        assert outcome == ("failed" if attempt == 3 else "queued")
    with sessions.begin() as s:
        assert repo.claim_next(s, "w") is None
        assert repo.finish_job_if_done(s, job.id)
    with sessions() as s:
        j = repo.get_job(s, job.id)
        sample = repo.get_sample(s, job.id, "s0")
        attempts = repo.sample_attempts(s, sample.pk)
    assert (j.state, j.n_failed, j.n_queued) == ("failed", 1, 0)
    assert sample.last_error == "no_dump: try 3"
    assert [(a.number, a.outcome) for a in attempts] == [(1, "retry"), (2, "retry"), (3, "failed")]


def test_outage_does_not_spend_attempts(sessions):
    with sessions.begin() as s:
        repo.create_job(s, name=None, layers=None, samples=new_samples(1))
    for _ in range(5):
        with sessions.begin() as s:
            c = repo.claim_next(s, "w")
            repo.release_interrupted(s, c, reason="model server unavailable")
    with sessions.begin() as s:
        c = repo.claim_next(s, "w")
    assert c.attempt == 1


def test_recovery_requeues_running_and_lost_staged(sessions, tmp_path):
    with sessions.begin() as s:
        job = repo.create_job(s, name=None, layers=None, samples=new_samples(3))
    kept_dir = tmp_path / "kept"
    kept_dir.mkdir()
    (kept_dir / "done").touch()
    with sessions.begin() as s:
        a = repo.claim_next(s, "w")
        repo.mark_staged(
            s,
            a,
            writer="w",
            staged_path=str(kept_dir),
            observed_tokens=a.num_tokens,
            dump_key="req_1",
            boot_id="b",
            identity="ids",
        )
    with sessions.begin() as s:
        b = repo.claim_next(s, "w")
        repo.mark_staged(
            s,
            b,
            writer="w",
            staged_path=str(tmp_path / "gone"),
            observed_tokens=b.num_tokens,
            dump_key="req_2",
            boot_id="b",
            identity="ids",
        )
    with sessions.begin() as s:
        repo.claim_next(s, "w")  # running when the "crash" happens
    with sessions.begin() as s:
        requeued, kept = repo.recover_writer(s, "w", lambda p: (tmp_path / p / "done").exists())
    assert (requeued, kept) == (2, 1)
    with sessions() as s:
        j = repo.get_job(s, job.id)
    assert (j.n_queued, j.n_running, j.n_staged) == (2, 0, 1)


def end_job(sessions: sessionmaker[Session], job_id: str, *, cancel: bool) -> None:
    """Cancel the job and take its queued samples off in batches, as the cancel sweeper does, or fail it."""
    if not cancel:
        with sessions.begin() as s:
            repo.fail_job(s, job_id, "refused")
        return
    with sessions.begin() as s:
        repo.cancel_job(s, job_id)
    while True:
        with sessions.begin() as s:
            if repo.cancel_queued(s, job_id, 7) < 7:
                break


@pytest.mark.postgres
def test_cancel_and_fail_race_claims_without_deadlock(postgres_url):
    """Claims (several writers) racing cancel's batches and fail_job: every path takes the job row
    before sample rows, so Postgres never aborts one of them as a deadlock, and every job ends."""
    engine = make_engine(postgres_url)
    upgrade(engine)
    sessions = session_factory(engine)
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(name: str) -> None:
        while not stop.is_set():
            try:
                with sessions.begin() as s:
                    c = repo.claim_next(s, name)
                    if c is not None:
                        repo.record_failed_attempt(s, c, reason="again", max_attempts=1000)
            except BaseException as exc:  # any abort is the failure under test
                errors.append(exc)
                return

    threads = [threading.Thread(target=writer, args=(f"host:/dump/{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    jobs = []
    try:
        for round_ in range(40):
            with sessions.begin() as s:
                job_id = repo.create_job(s, name=None, layers=None, samples=new_samples(30)).id
            jobs.append(job_id)
            threading.Event().wait(0.002 * (round_ % 5))
            end_job(sessions, job_id, cancel=bool(round_ % 2))
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    with sessions() as s:
        for job_id in jobs:
            job = repo.get_job(s, job_id)
            assert job.n_queued == job.n_running == 0, (job.state, job.n_queued, job.n_running)
    engine.dispose()


def test_cancel_retry_and_fail_move_a_large_job_without_lists_of_keys(sessions):
    """Cancel's batches, fail and retry never send a list of keys: no statement carries more than a
    few parameters, so no job or batch is too large for SQLite's 32,766 bound parameters. The
    counters follow exactly."""
    n = 3_000
    ids = np.arange(1, 4, dtype="<i4").tobytes()
    with sessions.begin() as s:
        builder = repo.JobBuilder(s, name=None, layers=None)
        builder.add([repo.NewSample(f"s{i}", ids, None, 3) for i in range(n)])
        cancelled = builder.finish().id
        other = repo.create_job(
            s, name=None, layers=None, samples=[repo.NewSample(f"s{i}", ids, None, 3) for i in range(n)]
        ).id
    sizes: list[int] = []

    def record(conn, cursor, statement, parameters, context, executemany):
        sizes.append(len(parameters or ()))

    engine = sessions.kw["bind"]
    event.listen(engine, "before_cursor_execute", record)
    with sessions.begin() as s:
        claimed = repo.claim_next(s, "host:/dump/big")
        assert claimed.job_id == cancelled
        repo.cancel_job(s, cancelled)
        repo.fail_job(s, other, "refused")
    with sessions.begin() as s:
        assert repo.cancel_queued(s, cancelled, n) == n - 1
    event.remove(engine, "before_cursor_execute", record)
    assert sizes and max(sizes) < 50, max(sizes)
    with sessions() as s:
        job = repo.get_job(s, cancelled)
        assert (job.state, job.n_queued, job.n_running, job.n_cancelled) == ("cancelling", 0, 1, n - 1)
        job = repo.get_job(s, other)
        assert (job.n_queued, job.n_failed, job.tokens_total) == (0, n, 3 * n)
    with sessions.begin() as s:
        assert repo.retry_job(s, other) == n
    with sessions() as s:
        job = repo.get_job(s, other)
        assert (job.n_queued, job.n_failed) == (n, 0)
        assert repo.list_samples(s, other, state="queued", after_idx=n - 2, limit=5)[0].attempts == 0


def _job_state(sessions, job_id: str) -> tuple:
    with sessions() as s:
        j = repo.get_job(s, job_id)
        return j.state, j.n_queued, j.n_running, j.n_cancelled, j.tokens_total, j.tokens_done


def test_cancel_marks_the_job_and_its_queued_samples_follow_in_batches(sessions, tmp_path):
    """The cancel itself moves no sample; each batch cancels the next queued samples in input order with
    the counters in step. Nothing of a cancelling job is claimed, nor is the job finished while any of
    its samples is queued; a sweeper started afresh (after a crash half-way) completes the cancel."""
    samples = new_samples(25)
    with sessions.begin() as s:
        shared_output_root(s, tmp_path, mark=True)
        job_id = repo.create_job(s, name=None, layers=None, samples=samples).id
    with sessions.begin() as s:
        in_flight = repo.claim_next(s, "host:/dump/a")
    tokens = sum(x.num_tokens for x in samples)
    with sessions.begin() as s:
        job = repo.cancel_job(s, job_id)
        assert job is not None and job.cancel_requested_at is not None
    assert _job_state(sessions, job_id) == ("cancelling", 24, 1, 0, tokens, 0)
    with sessions.begin() as s:
        assert repo.cancel_job(s, job_id) is None, "a job already cancelling is not cancelled again"
        assert repo.retry_job(s, job_id) is None
        assert repo.delete_job(s, job_id) is False
    with sessions.begin() as s:
        later = repo.create_job(s, name=None, layers=None, samples=new_samples(2)).id
    with sessions.begin() as s:
        assert repo.cancel_queued(s, job_id, 10) == 10
        assert repo.claim_next(s, "host:/dump/b").job_id == later, "the cancelling job's samples are passed over"
        assert repo.claim_next(s, "host:/dump/c").job_id == later
        assert repo.claim_next(s, "host:/dump/d") is None
        assert not repo.finish_job_if_done(s, job_id)
    assert _job_state(sessions, job_id) == ("cancelling", 14, 1, 10, tokens, 0)
    with sessions() as s:
        cancelled = repo.list_samples(s, job_id, state="cancelled", after_idx=None, limit=100)
        assert [x.idx for x in cancelled] == list(range(1, 11))
    # The sample in flight ends (here: given back while the job is cancelling, so it is cancelled too).
    with sessions.begin() as s:
        repo.release_interrupted(s, in_flight, reason="server restarted")
    assert _job_state(sessions, job_id) == ("cancelling", 14, 0, 11, tokens, 0)

    # What a writer's crash left in the job's folder: a shard half written, one written but never recorded.
    folder = tmp_path / job_id
    folder.mkdir()
    leftovers = [folder / ".shard-000002.safetensors.tmp-4242-1", folder / "shard-000003.safetensors"]
    for p in leftovers:
        p.write_bytes(b"partial")

    # The process that took the cancel is gone; another's sweeper finds the job and completes it.
    sweeper = CancelSweeper(sessions, tmp_path, batch=4)
    assert sweeper.sweep() == [job_id]
    assert not any(p.exists() for p in leftovers), "the job's folder holds its manifest and recorded shards only"
    state, queued, running, n_cancelled, total, done = _job_state(sessions, job_id)
    assert (state, queued, running, n_cancelled, total, done) == ("cancelled", 0, 0, 25, tokens, 0)
    with sessions() as s:
        assert repo.get_job(s, job_id).finished_at is not None
        assert repo.list_samples(s, job_id, state="queued", after_idx=None, limit=1) == []
    assert (tmp_path / job_id / "manifest.json").exists()
    assert sweeper.sweep() == [], "nothing is left to do"


def test_a_cancelling_job_with_samples_in_flight_ends_when_they_are_stored(sessions, tmp_path):
    """Once its queued samples are cancelled, a job whose sample is still running stays cancelling; the
    sample finishes and is stored, and the job ends cancelled with it."""
    with sessions.begin() as s:
        shared_output_root(s, tmp_path, mark=True)
        job_id = repo.create_job(s, name=None, layers=None, samples=new_samples(5)).id
    with sessions.begin() as s:
        c = repo.claim_next(s, "host:/dump/a")
        repo.cancel_job(s, job_id)
    sweeper = CancelSweeper(sessions, tmp_path, batch=2)
    assert sweeper.sweep() == []
    assert _job_state(sessions, job_id)[:4] == ("cancelling", 0, 1, 4)
    with sessions.begin() as s:
        repo.mark_staged(
            s,
            c,
            writer="host:/dump/a",
            staged_path="x",
            observed_tokens=c.num_tokens,
            dump_key=None,
            boot_id=None,
            identity="ids",
        )
        repo.commit_shard(
            s,
            job_id,
            name="shard-00000.safetensors",
            nbytes=1,
            sha256="0" * 64,
            placed=[(c.sample_pk, 0, c.num_tokens)],
        )
    assert sweeper.sweep() == [job_id]
    with sessions() as s:
        job = repo.get_job(s, job_id)
        assert (job.state, job.n_succeeded, job.n_cancelled, job.tokens_done) == ("cancelled", 1, 4, c.num_tokens)


def test_sweepers_of_several_processes_share_one_cancel(sessions, tmp_path):
    """Sweepers draining the same job at once take turns on its row: every queued sample is cancelled
    exactly once and the counters add up."""
    n = 600
    with sessions.begin() as s:
        shared_output_root(s, tmp_path, mark=True)
        job_id = repo.create_job(s, name=None, layers=None, samples=new_samples(n)).id
        repo.cancel_job(s, job_id)
    sweepers = [CancelSweeper(sessions, tmp_path, batch=25) for _ in range(3)]
    errors: list[BaseException] = []

    def drain(sweeper: CancelSweeper) -> None:
        try:
            sweeper.drain(job_id)
        except BaseException as exc:  # any failure is the one under test
            errors.append(exc)

    threads = [threading.Thread(target=drain, args=(sw,)) for sw in sweepers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    with sessions() as s:
        job = repo.get_job(s, job_id)
        assert (job.state, job.n_queued, job.n_cancelled) == ("cancelled", 0, n)
        assert (
            s.execute(select(func.count()).where(SampleRow.job_id == job_id, SampleRow.state == "cancelled")).scalar()
            == n
        )


def test_throughput_is_counted_per_window_and_read_back_in_equal_windows(sessions):
    with sessions.begin() as s:
        job = repo.create_job(s, name=None, layers=None, samples=new_samples(2))
    before = time.time()
    with sessions.begin() as s:
        c = repo.claim_next(s, "host:/dump/t")
        repo.mark_staged(
            s,
            c,
            writer="host:/dump/t",
            staged_path="/x",
            observed_tokens=c.num_tokens,
            dump_key=None,
            boot_id=None,
            identity="ids",
        )
    with sessions() as s:
        (row,) = s.execute(select(ThroughputRow).where(ThroughputRow.job_id == job.id)).scalars()
        assert (row.samples, row.tokens) == (1, c.num_tokens)
        assert row.bucket_start % repo.THROUGHPUT_BUCKET_S == 0 and before - 5 <= row.bucket_start <= time.time()

    # A history drawn by hand: 2 samples at t0, none at t0 + 5, 1 at t0 + 10; the job started at t0 + 3.
    t0 = 1_800_000_000
    with sessions.begin() as s:
        other = repo.create_job(s, name=None, layers=None, samples=new_samples(3))
        other_id = other.id
        assert repo.job_throughput(s, other, points=10, now=t0) == (repo.THROUGHPUT_BUCKET_S, [])
        other.started_at = datetime.fromtimestamp(t0 + 3, timezone.utc)
        s.add_all(
            [
                ThroughputRow(job_id=other.id, bucket_start=t0, samples=2, tokens=100),
                ThroughputRow(job_id=other.id, bucket_start=t0 + 10, samples=1, tokens=50),
            ]
        )
    P = repo.ThroughputPoint
    with sessions() as s:
        other = repo.get_job(s, other_id)
        # Running, now at t0 + 12: the last window is 2 s old.
        assert repo.job_throughput(s, other, points=120, now=t0 + 12) == (
            5,
            [P(t0, 2.0, 2, 100), P(t0 + 5, 5.0, 0, 0), P(t0 + 10, 2.0, 1, 50)],
        )
        # At most two windows: each twice as wide.
        assert repo.job_throughput(s, other, points=2, now=t0 + 12) == (
            10,
            [P(t0, 7.0, 2, 100), P(t0 + 10, 2.0, 1, 50)],
        )
        # Still running a minute later, with nothing extracted since: the windows go on, empty.
        width, later = repo.job_throughput(s, other, points=120, now=t0 + 60)
        assert width == 5 and len(later) == 12 and later[-1] == P(t0 + 55, 5.0, 0, 0)
        other.finished_at = datetime.fromtimestamp(t0 + 11, timezone.utc)
        assert repo.job_throughput(s, other, points=120, now=t0 + 60)[1][-1] == P(t0 + 10, 1.0, 1, 50)
        s.rollback()

    with sessions.begin() as s:
        repo.fail_job(s, other_id, "done with it")
        assert repo.finish_job_if_done(s, other_id)
    with sessions.begin() as s:
        assert repo.delete_job(s, other_id) is True
    with sessions() as s:
        assert s.execute(select(ThroughputRow).where(ThroughputRow.job_id == other_id)).first() is None

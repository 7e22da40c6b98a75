"""Read-only queries: jobs, samples, attempts and shards, one or a page at a time, counts by state, and
the round trip that says whether the database answers."""

from __future__ import annotations

from collections.abc import Iterator

from sqlalchemy import Row, func, select, text
from sqlalchemy.orm import Session

from hsx.db.models import AttemptCountRow, AttemptRow, JobRow, SampleRow, ShardRow
from hsx.names import could_be_stored
from hsx.states import ACTIVE_JOB_STATES, SampleState


def get_job(session: Session, job_id: str) -> JobRow | None:
    if not could_be_stored(job_id):
        return None
    return session.get(JobRow, job_id)


def list_jobs(session: Session, *, state: str | None, after: str | None, limit: int) -> list[JobRow]:
    """Newest first; `after` is the id the previous page ended with (ids sort by creation)."""
    q = select(JobRow)
    if state:
        q = q.where(JobRow.state == state)
    if after:
        q = q.where(JobRow.id < after)
    return list(session.execute(q.order_by(JobRow.id.desc()).limit(limit)).scalars())


def list_samples(
    session: Session, job_id: str, *, state: str | None, after_idx: int | None, limit: int
) -> list[SampleRow]:
    q = select(SampleRow).where(SampleRow.job_id == job_id)
    if state:
        q = q.where(SampleRow.state == state)
    if after_idx is not None:
        q = q.where(SampleRow.idx > after_idx)
    return list(session.execute(q.order_by(SampleRow.idx).limit(limit)).scalars())


def get_sample(session: Session, job_id: str, sample_id: str) -> SampleRow | None:
    if not (could_be_stored(job_id) and could_be_stored(sample_id)):
        return None
    return session.execute(
        select(SampleRow).where(SampleRow.job_id == job_id, SampleRow.sample_id == sample_id)
    ).scalar_one_or_none()


def sample_attempts(session: Session, sample_pk: int) -> list[AttemptRow]:
    return list(
        session.execute(
            select(AttemptRow).where(AttemptRow.sample_pk == sample_pk).order_by(AttemptRow.number, AttemptRow.pk)
        ).scalars()
    )


def job_shards(session: Session, job_id: str) -> list[ShardRow]:
    return list(session.execute(select(ShardRow).where(ShardRow.job_id == job_id).order_by(ShardRow.seq)).scalars())


def get_shard(session: Session, job_id: str, name: str) -> ShardRow | None:
    if not (could_be_stored(job_id) and could_be_stored(name)):
        return None
    return session.execute(
        select(ShardRow).where(ShardRow.job_id == job_id, ShardRow.name == name)
    ).scalar_one_or_none()


def iter_stored_samples(
    session: Session, job_id: str, batch: int = 10000
) -> Iterator[Row[int, str, str | None, int | None, int, str | None, int | None]]:
    """(sample_id, shard, offset, num_tokens, identity, truncated_from) of every stored sample, in job order, in
    batches."""
    last = -1
    while True:
        rows = session.execute(
            select(
                SampleRow.idx,
                SampleRow.sample_id,
                SampleRow.shard,
                SampleRow.shard_offset,
                SampleRow.num_tokens,
                SampleRow.identity,
                SampleRow.truncated_from,
            )
            .where(SampleRow.job_id == job_id, SampleRow.state == SampleState.SUCCEEDED, SampleRow.idx > last)
            .order_by(SampleRow.idx)
            .limit(batch)
        ).all()
        if not rows:
            return
        yield from rows
        last = rows[-1].idx


def ping(session: Session) -> None:
    """A round trip to the database; raises what the driver raises when it cannot answer."""
    session.execute(text("SELECT 1"))


def jobs_by_state(session: Session) -> list[tuple[str, int]]:
    """How many jobs are in each state (a state no job is in is left out)."""
    rows = session.execute(select(JobRow.state, func.count()).group_by(JobRow.state)).all()
    return [(state, n) for state, n in rows]


def samples_by_state(session: Session) -> dict[SampleState, int]:
    """How many samples are in each state over all jobs, summed from the jobs' counters."""
    sums = session.execute(select(*[func.coalesce(func.sum(getattr(JobRow, f"n_{s}")), 0) for s in SampleState])).one()
    return dict(zip(SampleState, sums, strict=True))


def requeued_samples(session: Session) -> int:
    """Queued samples tried before (waiting for another attempt), over all jobs, from the jobs' counters."""
    return int(session.execute(select(func.coalesce(func.sum(JobRow.n_requeued), 0))).scalar_one())


def active_attempt_counts(session: Session) -> list[tuple[str, str, int]]:
    """(outcome, reason code, attempts) summed over the active jobs (queued, running, cancelling): a few
    rows per job, found through the jobs' state index."""
    rows = session.execute(
        select(AttemptCountRow.outcome, AttemptCountRow.reason, func.sum(AttemptCountRow.n))
        .join(JobRow, JobRow.id == AttemptCountRow.job_id)
        .where(JobRow.state.in_(ACTIVE_JOB_STATES))
        .group_by(AttemptCountRow.outcome, AttemptCountRow.reason)
        .order_by(AttemptCountRow.outcome, AttemptCountRow.reason)
    ).all()
    return [(outcome, reason, int(n)) for outcome, reason, n in rows if n]

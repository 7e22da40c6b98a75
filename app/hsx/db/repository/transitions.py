"""The one place sample and job states change.

A sample's life: queued -> running -> staged -> succeeded, or back to queued for a retry,
or failed / cancelled. Each move is a conditional UPDATE on the source state, and the job's
per-state counters move in the same transaction (n_requeued too: the queued samples tried before),
so progress never needs to count rows; so does prepared_at, when the last conversation leaves `preparing`.
"""

from __future__ import annotations

import functools
from typing import Any

from sqlalchemy import ColumnElement, Select, Update, bindparam, case, cast, func, null, select, update
from sqlalchemy.orm import Session
from sqlalchemy.sql.dml import ReturningUpdate

from hsx.db.models import JobRow, SampleRow
from hsx.db.repository._base import JOBS, SAMPLES, now_param, rowcount, utcnow
from hsx.states import JobState, SampleState


def lock_job(session: Session, job_id: str) -> JobRow | None:
    """Read the job row for update: cancel, retry and sample outcomes on one job serialise here. The
    row as locked, not as this session may have read it before the lock."""
    return session.execute(
        select(JobRow).where(JobRow.id == job_id).with_for_update().execution_options(populate_existing=True)
    ).scalar_one_or_none()


# Token counters that follow a sample's tokens in and out of a state.
TOKEN_COUNTERS = {SampleState.STAGED: JobRow.tokens_staged, SampleState.SUCCEEDED: JobRow.tokens_done}


ALL = None  # transition's `pks` for "every sample of the job in that state"


def transition(
    session: Session,
    job_id: str,
    pks: list[int] | None,
    src: SampleState,
    dst: SampleState,
    values: dict[str, Any],
    *,
    through_idx: int | None = None,
    where: ColumnElement[bool] | None = None,
    per_sample: dict[str, dict[int, Any]] | None = None,
) -> int:
    """Move the samples (`pks`, or ALL of the job's, only those up to `through_idx` and those `where`
    holds for when given) that are still in `src` to `dst`; keep the job's counters in step. `values`
    are set on every sample moved, `per_sample` column values on each sample by its pk.

    Lock order: the job row first, then sample rows, here and in claim_next, so that no two
    transitions on one job can deadlock and none can change a state's membership behind another.
    That makes ALL exact: one UPDATE on (job_id, state) whatever the job's size, with the count
    and tokens it moves summed by the database beforehand; no million keys or values travel.
    """
    if pks is not None and not pks:
        return 0
    session.execute(_job_lock(), {"p_job": job_id})
    now = utcnow()
    if pks is ALL:
        stamp = {"state": dst, "updated_at": now, **values}
        which = [SampleRow.job_id == job_id, SampleRow.state == src]
        if through_idx is not None:
            which.append(SampleRow.idx <= through_idx)
        if where is not None:
            which.append(where)
        rc, tokens, tried = session.execute(
            select(
                func.count(),
                func.coalesce(func.sum(SampleRow.num_tokens), 0),
                func.coalesce(func.sum(case((SampleRow.tries > 0, 1), else_=0)), 0),
            ).where(*which)
        ).one()
        if rc:
            result = session.execute(
                update(SampleRow).where(*which).values(stamp).execution_options(synchronize_session=False)
            )
            if rowcount(result) != rc:
                raise RuntimeError(f"job {job_id}: {rowcount(result)} samples left {src}, {rc} were counted")
    else:
        if per_sample or any(isinstance(v, ColumnElement) for v in values.values()):
            # Rare moves (SQL expressions, or a value per sample): built for the occasion.
            stamp = {"state": dst, "updated_at": now, **values}
            for column, by_pk in (per_sample or {}).items():
                # Typed as its column: a CASE whose every branch is NULL is text to Postgres, which then
                # refuses it for a bytea or integer column.
                stamp[column] = cast(case(by_pk, value=SAMPLES.c.pk), SAMPLES.c[column].type)
            statement = (
                update(SAMPLES)
                .where(SAMPLES.c.pk.in_(pks), SAMPLES.c.state == src)
                .values(stamp)
                .returning(SAMPLES.c.num_tokens, SAMPLES.c.tries)
            )
            params = {}
        else:
            statement = _sample_move(tuple(sorted(values)))
            params = {"p_pks": pks, "p_src": src, "p_dst": dst, "p_now": now} | {f"v_{k}": v for k, v in values.items()}
        moved = session.execute(statement, params).all()
        rc, tokens, tried = len(moved), sum(n for n, _ in moved), sum(1 for _, t in moved if t > 0)
    if rc:
        session.execute(
            _job_counters(src, dst),
            {"p_job": job_id, "p_rc": rc, "p_tokens": tokens, "p_tried": int(tried), "p_now": now},
        )
    return rc


@functools.cache
def _job_lock() -> Select[Any]:
    """The job row's lock (FOR UPDATE on Postgres; SQLite serialises writers by itself): see transition."""
    return select(JOBS.c.id).where(JOBS.c.id == bindparam("p_job")).with_for_update()


@functools.cache
def _sample_move(columns: tuple[str, ...]) -> ReturningUpdate[Any]:
    """Move samples by pk from one state to another, setting `columns` (bound as v_<column>)."""
    return (
        update(SAMPLES)
        .where(SAMPLES.c.pk.in_(bindparam("p_pks", expanding=True)), SAMPLES.c.state == bindparam("p_src"))
        .values(state=bindparam("p_dst"), updated_at=now_param(), **{c: bindparam(f"v_{c}") for c in columns})
        .returning(SAMPLES.c.num_tokens, SAMPLES.c.tries)
    )


@functools.cache
def _job_counters(src: SampleState, dst: SampleState) -> Update:
    """The job's counters follow p_rc samples (of p_tokens tokens, p_tried of them tried before) from
    `src` to `dst`."""
    src_col, dst_col = JOBS.c[f"n_{src}"], JOBS.c[f"n_{dst}"]
    changes = {src_col: src_col - bindparam("p_rc"), dst_col: dst_col + bindparam("p_rc")}
    requeued = JOBS.c.n_requeued  # the queued samples tried before
    if src == SampleState.QUEUED:
        changes[requeued] = requeued - bindparam("p_tried")
    if dst == SampleState.QUEUED:
        changes[requeued] = requeued + bindparam("p_tried")
    for state, column in TOKEN_COUNTERS.items():
        col = JOBS.c[column.key]
        if state == src:
            changes[col] = col - bindparam("p_tokens")
        if state == dst:
            changes[col] = col + bindparam("p_tokens")
    # The job's preparation ends when its last conversation leaves `preparing` (prepared, cancelled or
    # failed), and starts over when a retry sends conversations back to it.
    prepared_at = JOBS.c.prepared_at
    if src == SampleState.PREPARING:
        changes[prepared_at] = case((src_col - bindparam("p_rc") == 0, now_param()), else_=prepared_at)
    if dst == SampleState.PREPARING:
        changes[prepared_at] = null()
    return update(JOBS).where(JOBS.c.id == bindparam("p_job")).values(changes)


def requeue_state(session: Session, job_id: str) -> SampleState:
    """Where a sample goes for another attempt: the queue, unless its job is being cancelled."""
    job = lock_job(session, job_id)
    return SampleState.CANCELLED if job is not None and job.state == JobState.CANCELLING else SampleState.QUEUED

"""Every database query the service makes, and the one place sample and job states change.

A sample's life: queued -> running -> staged -> succeeded, or back to queued for a retry,
or failed / cancelled. Each move is a conditional UPDATE on the source state, and the job's
per-state counters move in the same transaction, so progress never needs to count rows.
"""

from __future__ import annotations

import functools
import math
import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import (
    BindParameter,
    ColumnElement,
    CursorResult,
    DateTime,
    Result,
    Table,
    bindparam,
    case,
    delete,
    exists,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from hsx.db.models import AttemptRow, JobRow, OutputRootRow, SampleRow, ShardRow, ThroughputRow, WriterRow
from hsx.matching import Serves, Waiting, layers_key
from hsx.names import could_be_stored
from hsx.states import ACTIVE_JOB_STATES, TERMINAL_JOB_STATES, JobState, SampleState

if TYPE_CHECKING:
    import psycopg


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def _rowcount(result: Result[Any]) -> int:
    """Rows an UPDATE or DELETE matched (Session.execute types every result as a plain Result)."""
    return cast(CursorResult[Any], result).rowcount


# The per-sample path (claim, stage, shard commit, and the lease check fencing each of their
# transactions) runs thousands of times a minute per writer. Building a SQLAlchemy statement costs
# far more CPU than the database spends running it, so those statements are built once per dialect
# (functools.cache), on the tables rather than the ORM classes, with every value a bind parameter.
_jobs, _samples, _attempts, _writers, _throughput = (
    cast(Table, row.__table__) for row in (JobRow, SampleRow, AttemptRow, WriterRow, ThroughputRow)
)


def _now_param() -> BindParameter[datetime]:
    return bindparam("p_now", type_=DateTime(timezone=True))


def _dialect(session: Session) -> str:
    return session.get_bind().dialect.name


def new_job_id() -> str:
    # Time-ordered so that ids sort by creation: cursor pagination and claim order rely on it.
    return f"job_{int(time.time() * 1000):012x}{secrets.token_hex(4)}"


@dataclass(frozen=True)
class NewSample:
    sample_id: str
    input_ids: bytes  # little-endian int32
    loss_mask: bytes | None  # one byte per token; None means all ones
    num_tokens: int


@dataclass(frozen=True)
class Claimed:
    sample_pk: int
    job_id: str
    idx: int
    sample_id: str
    input_ids: bytes
    loss_mask: bytes | None
    num_tokens: int
    attempt: int  # budget spent, this one included
    try_number: int  # unique per claim of this sample: names its request and staging folder
    attempt_pk: int
    job_layers: list[int] | None
    job_model_info: dict | None
    queued_left: int = 0  # the job's samples still queued after this claim


# --- jobs -------------------------------------------------------------------------------


_SAMPLE_INSERT_COLUMNS = (
    "job_id",
    "idx",
    "sample_id",
    "state",
    "input_ids",
    "loss_mask",
    "num_tokens",
    "attempts",
    "tries",
    "updated_at",
)


class JobBuilder:
    """Insert a job and its samples batch by batch inside the caller's transaction.

    Samples can stream in (a JSONL upload of a million lines never sits in memory whole); the
    job's counters are set once at the end, and a rollback leaves nothing behind.
    """

    def __init__(
        self,
        session: Session,
        *,
        name: str | None,
        layers: list[int] | None,
        idempotency_key: str | None = None,
        request_sha256: str | None = None,
    ):
        self.session = session
        self.job = JobRow(
            id=new_job_id(),
            name=name,
            state=JobState.QUEUED,
            created_at=utcnow(),
            layers=layers,
            layers_key=layers_key(layers),
            idempotency_key=idempotency_key,
            request_sha256=request_sha256,
            num_samples=0,
            tokens_total=0,
            tokens_done=0,
            tokens_staged=0,
            n_queued=0,
            n_running=0,
            n_staged=0,
            n_succeeded=0,
            n_failed=0,
            n_cancelled=0,
            shards_written=0,
        )
        session.add(self.job)
        session.flush()
        self.count = 0
        self.tokens = 0

    def add(self, samples: list[NewSample]) -> None:
        if not samples:
            return
        # A million-sample job is a million rows: they go to the driver's bulk path as plain tuples
        # (COPY on Postgres, executemany on SQLite), skipping a Core insert's per-row parameter
        # processing. Only updated_at needs the column type's conversion, one value for all rows.
        conn = self.session.connection()
        updated_at = SampleRow.__table__.c.updated_at.type.bind_processor(conn.dialect)
        now = updated_at(self.job.created_at) if updated_at else self.job.created_at
        job_id, first = self.job.id, self.count
        rows = [
            (job_id, first + i, s.sample_id, SampleState.QUEUED, s.input_ids, s.loss_mask, s.num_tokens, 0, 0, now)
            for i, s in enumerate(samples)
        ]
        columns = ", ".join(_SAMPLE_INSERT_COLUMNS)
        if conn.dialect.name == "postgresql":
            # COPY is psycopg's, not the DB-API's; make_engine always picks psycopg for Postgres.
            driver = cast("psycopg.Connection[Any]", conn.connection.driver_connection)
            with driver.cursor() as cursor:
                with cursor.copy(f"COPY samples ({columns}) FROM STDIN") as copy:
                    for row in rows:
                        copy.write_row(row)
        else:
            marks = ", ".join("?" * len(_SAMPLE_INSERT_COLUMNS))
            conn.exec_driver_sql(f"INSERT INTO samples ({columns}) VALUES ({marks})", rows)
        self.count += len(samples)
        self.tokens += sum(s.num_tokens for s in samples)

    def finish(self) -> JobRow:
        self.job.num_samples = self.job.n_queued = self.count
        self.job.tokens_total = self.tokens
        self.session.flush()
        return self.job


def create_job(session: Session, *, name: str | None, layers: list[int] | None, samples: list[NewSample]) -> JobRow:
    """Insert a job and all its samples, queued, in the caller's transaction."""
    builder = JobBuilder(session, name=name, layers=layers)
    for start in range(0, len(samples), 5000):
        builder.add(samples[start : start + 5000])
    return builder.finish()


def pending_output_bytes(session: Session, *, besides: str | None = None) -> int:
    """Bytes the active jobs (all but the job `besides`) have still to write, from their estimates and
    progress."""
    q = select(JobRow.estimated_bytes, JobRow.tokens_total, JobRow.tokens_done).where(
        JobRow.state.in_((JobState.QUEUED, JobState.RUNNING)), JobRow.estimated_bytes.is_not(None)
    )
    if besides is not None:
        q = q.where(JobRow.id != besides)
    rows = session.execute(q).all()
    return sum(int(estimated * (total - done) / total) for estimated, total, done in rows if estimated and total)


def job_by_idempotency_key(session: Session, key: str) -> JobRow | None:
    return session.execute(select(JobRow).where(JobRow.idempotency_key == key)).scalar_one_or_none()


def list_jobs(session: Session, *, state: str | None, after: str | None, limit: int) -> list[JobRow]:
    """Newest first; `after` is the id the previous page ended with (ids sort by creation)."""
    q = select(JobRow)
    if state:
        q = q.where(JobRow.state == state)
    if after:
        q = q.where(JobRow.id < after)
    return list(session.execute(q.order_by(JobRow.id.desc()).limit(limit)).scalars())


def _lock_job(session: Session, job_id: str) -> JobRow | None:
    """Read the job row for update: cancel, retry and sample outcomes on one job serialise here. The
    row as locked, not as this session may have read it before the lock."""
    return session.execute(
        select(JobRow).where(JobRow.id == job_id).with_for_update().execution_options(populate_existing=True)
    ).scalar_one_or_none()


def cancel_job(session: Session, job_id: str) -> JobRow | None:
    """Mark the job cancelling: no sample of it is claimed from now on, and its queued samples are
    cancelled afterwards, batch by batch (cancel_queued), so that the request answers at once
    whatever the job's size; running or staged ones finish and are stored. Returns None when the
    job is not queued or running (finished, or already cancelling)."""
    job = _lock_job(session, job_id)
    if job is None or job.state not in (JobState.QUEUED, JobState.RUNNING):
        return None
    job.state, job.cancel_requested_at = JobState.CANCELLING, utcnow()
    session.flush()
    return job


def cancelling_jobs(session: Session) -> list[str]:
    """The jobs being cancelled, oldest first: those whose queued samples or end are still due."""
    return list(
        session.execute(select(JobRow.id).where(JobRow.state == JobState.CANCELLING).order_by(JobRow.id)).scalars()
    )


def cancel_queued(session: Session, job_id: str, limit: int) -> int:
    """Cancel up to `limit` queued samples of a cancelling job (the first in input order); returns how
    many. Each call cancels what is still queued under the job-row lock, so calls from several
    processes at once only take turns, and one repeated after a crash does no harm."""
    job = _lock_job(session, job_id)
    if job is None or job.state != JobState.CANCELLING or not job.n_queued:
        return 0
    # The index on (job_id, state, idx) finds the batch's last sample without reading the rows;
    # fewer than `limit` left: all of them.
    last = session.execute(
        select(SampleRow.idx)
        .where(SampleRow.job_id == job_id, SampleRow.state == SampleState.QUEUED)
        .order_by(SampleRow.idx)
        .offset(max(limit, 1) - 1)
        .limit(1)
    ).scalar()
    return _transition(
        session, job_id, ALL, SampleState.QUEUED, SampleState.CANCELLED, {"writer": None}, through_idx=last
    )


def retry_failed(session: Session, job_id: str) -> int | None:
    """Queue the job's failed samples again with a fresh attempt budget. None: not allowed now."""
    job = _lock_job(session, job_id)
    if job is None or job.state in (JobState.CANCELLING, JobState.CANCELLED) or job.n_failed == 0:
        return None
    moved = _transition(session, job_id, ALL, SampleState.FAILED, SampleState.QUEUED, {"attempts": 0, "writer": None})
    session.execute(
        update(JobRow)
        .where(JobRow.id == job_id)
        .values(
            state=case((JobRow.started_at.is_(None), JobState.QUEUED), else_=JobState.RUNNING),
            finished_at=None,
            error=None,
        )
    )
    return moved


def delete_job(session: Session, job_id: str) -> bool | None:
    """Delete a finished job's rows. None: not found; False: not finished yet."""
    job = _lock_job(session, job_id)
    if job is None:
        return None
    if job.state not in TERMINAL_JOB_STATES:
        return False
    sample_pks = select(SampleRow.pk).where(SampleRow.job_id == job_id)
    session.execute(delete(AttemptRow).where(AttemptRow.sample_pk.in_(sample_pks)))
    session.execute(delete(SampleRow).where(SampleRow.job_id == job_id))
    session.execute(delete(ShardRow).where(ShardRow.job_id == job_id))
    session.execute(delete(ThroughputRow).where(ThroughputRow.job_id == job_id))
    session.execute(delete(JobRow).where(JobRow.id == job_id))
    return True


def get_job(session: Session, job_id: str) -> JobRow | None:
    if not could_be_stored(job_id):
        return None
    return session.get(JobRow, job_id)


def set_job_model_info(session: Session, job_id: str, info: dict, serves: Serves) -> dict:
    """Record the model the job's first dump came from, and from then on which workers may claim
    its samples (those serving that model and those layers); return what is recorded."""
    session.execute(
        update(JobRow)
        .where(JobRow.id == job_id, JobRow.model_info.is_(None))
        .values(
            model_info=info,
            model_key=serves.model,
            layers_key=func.coalesce(JobRow.layers_key, layers_key(info.get("layers"))),
        )
    )
    return session.execute(select(JobRow.model_info).where(JobRow.id == job_id)).scalar_one()


def final_state(job: JobRow) -> JobState | None:
    """The state a job ends in once nothing is queued, running or staged; None before that."""
    if job.state not in ACTIVE_JOB_STATES or job.n_queued or job.n_running or job.n_staged:
        return None
    if job.state == JobState.CANCELLING:
        return JobState.CANCELLED
    return JobState.FAILED if job.n_failed else JobState.SUCCEEDED


def finish_job_if_done(session: Session, job_id: str) -> bool:
    """Move a job to its terminal state (final_state's rule) once no sample is queued, running or staged."""
    job = _lock_job(session, job_id)
    if job is None:
        return False
    state = final_state(job)
    if state is None:
        return False
    result = session.execute(
        update(JobRow)
        .where(
            JobRow.id == job_id,
            JobRow.state == job.state,
            JobRow.n_queued == 0,
            JobRow.n_running == 0,
            JobRow.n_staged == 0,
        )
        .values(state=state, finished_at=utcnow())
    )
    return _rowcount(result) == 1


def fail_job(session: Session, job_id: str, reason: str) -> None:
    """A job that cannot run at all (e.g. server settings that break dumps): fail what is queued."""
    session.execute(update(JobRow).where(JobRow.id == job_id).values(error=reason))
    _transition(session, job_id, ALL, SampleState.QUEUED, SampleState.FAILED, {"last_error": reason})


# --- sample transitions -------------------------------------------------------------------


# Token counters that follow a sample's tokens in and out of a state.
TOKEN_COUNTERS = {SampleState.STAGED: JobRow.tokens_staged, SampleState.SUCCEEDED: JobRow.tokens_done}


ALL = None  # _transition's `pks` for "every sample of the job in that state"


def _transition(
    session: Session,
    job_id: str,
    pks: list[int] | None,
    src: SampleState,
    dst: SampleState,
    values: dict,
    *,
    through_idx: int | None = None,
    per_sample: dict[str, dict[int, Any]] | None = None,
) -> int:
    """Move the samples (`pks`, or ALL of the job's, only those up to `through_idx` when given) that
    are still in `src` to `dst`; keep the job's counters in step. `values` are set on every sample
    moved, `per_sample` column values on each sample by its pk.

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
        rc, tokens = session.execute(
            select(func.count(), func.coalesce(func.sum(SampleRow.num_tokens), 0)).where(*which)
        ).one()
        if rc:
            result = session.execute(
                update(SampleRow).where(*which).values(stamp).execution_options(synchronize_session=False)
            )
            if _rowcount(result) != rc:
                raise RuntimeError(f"job {job_id}: {_rowcount(result)} samples left {src}, {rc} were counted")
    else:
        if per_sample or any(isinstance(v, ColumnElement) for v in values.values()):
            # Rare moves (SQL expressions, or a value per sample): built for the occasion.
            stamp = {"state": dst, "updated_at": now, **values}
            for column, by_pk in (per_sample or {}).items():
                stamp[column] = case(by_pk, value=_samples.c.pk)
            statement = (
                update(_samples)
                .where(_samples.c.pk.in_(pks), _samples.c.state == src)
                .values(stamp)
                .returning(_samples.c.num_tokens)
            )
            params = {}
        else:
            statement = _sample_move(tuple(sorted(values)))
            params = {"p_pks": pks, "p_src": src, "p_dst": dst, "p_now": now} | {f"v_{k}": v for k, v in values.items()}
        moved = session.execute(statement, params).scalars().all()
        rc, tokens = len(moved), sum(moved)
    if rc:
        session.execute(_job_counters(src, dst), {"p_job": job_id, "p_rc": rc, "p_tokens": tokens})
    return rc


@functools.cache
def _job_lock():
    """The job row's lock (FOR UPDATE on Postgres; SQLite serialises writers by itself): see _transition."""
    return select(_jobs.c.id).where(_jobs.c.id == bindparam("p_job")).with_for_update()


@functools.cache
def _sample_move(columns: tuple[str, ...]):
    """Move samples by pk from one state to another, setting `columns` (bound as v_<column>)."""
    return (
        update(_samples)
        .where(_samples.c.pk.in_(bindparam("p_pks", expanding=True)), _samples.c.state == bindparam("p_src"))
        .values(state=bindparam("p_dst"), updated_at=_now_param(), **{c: bindparam(f"v_{c}") for c in columns})
        .returning(_samples.c.num_tokens)
    )


@functools.cache
def _job_counters(src: SampleState, dst: SampleState):
    """The job's counters follow p_rc samples (of p_tokens tokens) from `src` to `dst`."""
    src_col, dst_col = _jobs.c[f"n_{src}"], _jobs.c[f"n_{dst}"]
    changes = {src_col: src_col - bindparam("p_rc"), dst_col: dst_col + bindparam("p_rc")}
    for state, column in TOKEN_COUNTERS.items():
        col = _jobs.c[column.key]
        if state == src:
            changes[col] = col - bindparam("p_tokens")
        if state == dst:
            changes[col] = col + bindparam("p_tokens")
    return update(_jobs).where(_jobs.c.id == bindparam("p_job")).values(changes)


def claim_next(session: Session, writer: str, serves: Serves | None = None) -> Claimed | None:
    """Take the oldest queued sample for `writer`, unless that writer already runs one; with
    `serves`, only of a job that worker may run (hsx.matching).

    Lock order is the same on every path that moves samples of a job: the job row first, then
    sample rows. So the claim locks the oldest job with queued samples before its sample; on
    Postgres a claim racing a cancel (job, then its queued samples) would otherwise deadlock.
    Claims on one job serialise on that row anyway (each updates its counters); SKIP LOCKED on
    the sample and the partial unique index on running samples per writer are the backstops.
    SQLite serialises writers by itself and ignores the row locks.
    """
    serves = serves or Serves(None, None)
    statements = _claim(_dialect(session), serves.layers is not None, serves.model is not None)
    now = utcnow()
    params = {"p_writer": writer, "p_now": now, "p_layers": serves.layers, "p_model": serves.model}
    job_id = session.execute(statements.job, params).scalar()
    if job_id is None:
        return None
    params["p_job"] = job_id
    row = session.execute(statements.sample, params).first()
    if row is None:
        return None
    job = session.execute(statements.counters, params).one()
    attempt_pk = session.execute(
        statements.attempt, {"p_pk": row.pk, "p_number": row.tries, "p_writer": writer, "p_now": now}
    ).scalar_one()
    return Claimed(
        row.pk,
        job_id,
        row.idx,
        row.sample_id,
        row.input_ids,
        row.loss_mask,
        row.num_tokens,
        row.attempts,
        row.tries,
        attempt_pk,
        job.layers,
        job.model_info,
        job.n_queued,
    )


@dataclass(frozen=True)
class _ClaimStatements:
    job: Any  # the oldest job the worker may claim from that has a queued sample, locked
    sample: Any  # that job's first queued sample, now running for the writer unless it runs one
    counters: Any  # the job's counters (and state: running from its first claim), returning what the claim needs
    attempt: Any  # the attempt's row


@functools.cache
def _claim(dialect: str, by_layers: bool, by_model: bool) -> _ClaimStatements:
    # The queued rows themselves, not the n_queued counter, say whether a job has work: a job can
    # never be picked for nothing while another waits.
    has_queued = exists().where(_samples.c.job_id == _jobs.c.id, _samples.c.state == SampleState.QUEUED)
    keys = ((_jobs.c.layers_key, "p_layers", by_layers), (_jobs.c.model_key, "p_model", by_model))
    # hsx.matching: jobs of no key yet, or of the worker's own
    runs_on = [or_(column.is_(None), column == bindparam(param)) for column, param, wanted in keys if wanted]
    job = (
        select(_jobs.c.id)
        .where(_jobs.c.state.in_((JobState.QUEUED, JobState.RUNNING)), *runs_on, has_queued)
        .order_by(_jobs.c.id)
        .limit(1)
        .with_for_update(of=_jobs)
    )
    pick = (
        select(_samples.c.pk)
        .where(_samples.c.job_id == bindparam("p_job"), _samples.c.state == SampleState.QUEUED)
        .order_by(_samples.c.idx)
        .limit(1)
    )
    if dialect == "postgresql":
        pick = pick.with_for_update(skip_locked=True)
    other = _samples.alias("other")
    busy = exists().where(other.c.state == SampleState.RUNNING, other.c.writer == bindparam("p_writer"))
    sample = (
        update(_samples)
        .where(_samples.c.pk == pick.scalar_subquery(), _samples.c.state == SampleState.QUEUED, ~busy)
        .values(
            state=SampleState.RUNNING,
            writer=bindparam("p_writer"),
            attempts=_samples.c.attempts + 1,
            tries=_samples.c.tries + 1,
            updated_at=_now_param(),
        )
        .returning(
            _samples.c.pk,
            _samples.c.idx,
            _samples.c.sample_id,
            _samples.c.input_ids,
            _samples.c.loss_mask,
            _samples.c.num_tokens,
            _samples.c.attempts,
            _samples.c.tries,
        )
    )
    first = _jobs.c.state == JobState.QUEUED
    counters = (
        update(_jobs)
        .where(_jobs.c.id == bindparam("p_job"))
        .values(
            n_queued=_jobs.c.n_queued - 1,
            n_running=_jobs.c.n_running + 1,
            state=case((first, JobState.RUNNING), else_=_jobs.c.state),
            started_at=case((first, _now_param()), else_=_jobs.c.started_at),
        )
        .returning(_jobs.c.n_queued, _jobs.c.layers, _jobs.c.model_info)
    )
    attempt = (
        insert(_attempts)
        .values(
            sample_pk=bindparam("p_pk"),
            number=bindparam("p_number"),
            writer=bindparam("p_writer"),
            started_at=_now_param(),
        )
        .returning(_attempts.c.pk)
    )
    return _ClaimStatements(job, sample, counters, attempt)


def _close_attempt(session: Session, attempt_pk: int, outcome: str, reason: str | None = None, **fields) -> None:
    params = {"p_pk": attempt_pk, "p_outcome": outcome, "p_reason": reason, "p_now": utcnow()}
    session.execute(_attempt_close(tuple(sorted(fields))), params | {f"v_{k}": v for k, v in fields.items()})


@functools.cache
def _attempt_close(columns: tuple[str, ...]):
    return (
        update(_attempts)
        .where(_attempts.c.pk == bindparam("p_pk"))
        .values(
            outcome=bindparam("p_outcome"),
            reason=bindparam("p_reason"),
            finished_at=_now_param(),
            **{c: bindparam(f"v_{c}") for c in columns},
        )
    )


def mark_staged(
    session: Session,
    c: Claimed,
    *,
    writer: str,
    staged_path: str,
    observed_tokens: int,
    dump_key: str | None,
    boot_id: str | None,
    identity: str | None,
) -> bool:
    """The dump is validated and out of the root. `writer` is the dump root's writer (not the
    in-flight slot that ran it): the writer's shard flusher takes it from here. `identity` is what
    proved the dump the sample's (hsx.identity)."""
    _close_attempt(
        session,
        c.attempt_pk,
        "ok",
        dump_key=dump_key,
        observed_tokens=observed_tokens,
        boot_id=boot_id,
        identity=identity,
    )
    moved = _transition(
        session,
        c.job_id,
        [c.sample_pk],
        SampleState.RUNNING,
        SampleState.STAGED,
        {
            "staged_path": staged_path,
            "observed_tokens": observed_tokens,
            "last_error": None,
            "writer": writer,
            "identity": identity,
        },
    )
    if moved:
        _count_throughput(session, c.job_id, samples=1, tokens=observed_tokens)
    return moved == 1


def queued_left(session: Session, job_id: str) -> int:
    """How many of the job's samples are queued (0 for a job that is gone)."""
    return session.execute(_queued_count(), {"p_job": job_id}).scalar() or 0


@functools.cache
def _queued_count():
    return select(_jobs.c.n_queued).where(_jobs.c.id == bindparam("p_job"))


def _requeue_state(session: Session, job_id: str) -> SampleState:
    """Where a sample goes for another attempt: the queue, unless its job is being cancelled."""
    job = _lock_job(session, job_id)
    return SampleState.CANCELLED if job is not None and job.state == JobState.CANCELLING else SampleState.QUEUED


def record_failed_attempt(
    session: Session,
    c: Claimed,
    *,
    reason: str,
    max_attempts: int,
    observed_tokens: int | None = None,
    dump_key: str | None = None,
    boot_id: str | None = None,
) -> SampleState:
    """Close a failed attempt; queue the sample again, or fail it once its budget is spent."""
    final = c.attempt >= max_attempts
    _close_attempt(
        session,
        c.attempt_pk,
        "failed" if final else "retry",
        reason,
        observed_tokens=observed_tokens,
        dump_key=dump_key,
        boot_id=boot_id,
    )
    dst = SampleState.FAILED if final else _requeue_state(session, c.job_id)
    values = {"last_error": reason, "observed_tokens": observed_tokens}
    if not final:
        values["writer"] = None
    _transition(session, c.job_id, [c.sample_pk], SampleState.RUNNING, dst, values)
    return dst


def release_interrupted(session: Session, c: Claimed, *, reason: str) -> None:
    """Give the sample back without spending an attempt: the server, not the sample, failed."""
    _close_attempt(session, c.attempt_pk, "interrupted", reason)
    _transition(
        session,
        c.job_id,
        [c.sample_pk],
        SampleState.RUNNING,
        _requeue_state(session, c.job_id),
        {"writer": None, "attempts": SampleRow.attempts - 1, "last_error": reason},
    )


def _writer_or_slots(writer: str):
    """The writer itself or any of its in-flight slots ("<writer>#<n>")."""
    return or_(SampleRow.writer == writer, SampleRow.writer.startswith(writer + "#", autoescape=True))


def recover_writer(
    session: Session, writer: str, staged_exists, *, why: str = "service stopped during the attempt"
) -> tuple[int, int]:
    """At writer start: its running samples were interrupted by a crash; staged ones keep their
    place only if their staged files survived. Returns (requeued, kept staged)."""
    requeued = kept = 0
    running = session.execute(
        select(SampleRow.pk, SampleRow.job_id).where(_writer_or_slots(writer), SampleRow.state == SampleState.RUNNING)
    ).all()
    for pk, job_id in running:
        session.execute(
            update(AttemptRow)
            .where(AttemptRow.sample_pk == pk, AttemptRow.outcome.is_(None))
            .values(outcome="interrupted", reason=why, finished_at=utcnow())
        )
        requeued += _transition(
            session,
            job_id,
            [pk],
            SampleState.RUNNING,
            _requeue_state(session, job_id),
            {"writer": None, "attempts": SampleRow.attempts - 1},
        )
    staged = session.execute(
        select(SampleRow.pk, SampleRow.job_id, SampleRow.staged_path).where(
            SampleRow.writer == writer, SampleRow.state == SampleState.STAGED
        )
    ).all()
    for pk, job_id, path in staged:
        if path and staged_exists(path):
            kept += 1
        else:
            requeued += _transition(
                session,
                job_id,
                [pk],
                SampleState.STAGED,
                _requeue_state(session, job_id),
                {
                    "writer": None,
                    "staged_path": None,
                    "attempts": SampleRow.attempts - 1,
                    "last_error": "staged dump was lost before its shard was written",
                },
            )
    return requeued, kept


PKS_PER_QUERY = 500


def staged_samples(
    session: Session, writer: str, job_id: str | None = None, *, pks: list[int] | None = None
) -> list[SampleRow]:
    """The writer's staged samples (of one job, and of those `pks` only, if given), in job order."""
    q = select(SampleRow).where(SampleRow.writer == writer, SampleRow.state == SampleState.STAGED)
    if job_id is not None:
        q = q.where(SampleRow.job_id == job_id)
    if pks is None:
        return list(session.execute(q.order_by(SampleRow.job_id, SampleRow.idx)).scalars())
    # A shard of small samples names many thousands: asked in parts, each within any database's limit on parameters.
    rows = [
        row
        for start in range(0, len(pks), PKS_PER_QUERY)
        for row in session.execute(q.where(SampleRow.pk.in_(pks[start : start + PKS_PER_QUERY]))).scalars()
    ]
    return sorted(rows, key=lambda r: (r.job_id, r.idx))


def running_samples(session: Session, writer: str, job_id: str) -> int:
    """How many of the job's samples the writer (or one of its in-flight slots) is running now."""
    return session.execute(
        select(func.count()).where(
            SampleRow.job_id == job_id, SampleRow.state == SampleState.RUNNING, _writer_or_slots(writer)
        )
    ).scalar_one()


def requeue_staged(session: Session, job_id: str, pks: list[int], reason: str) -> None:
    _transition(
        session,
        job_id,
        pks,
        SampleState.STAGED,
        _requeue_state(session, job_id),
        {"writer": None, "staged_path": None, "last_error": reason},
    )


def reject_staged(session: Session, job_id: str, pk: int, *, reason: str, max_attempts: int) -> SampleState:
    """Writing the shard found what staging does not check (NaN or Inf among the values): the
    attempt that staged the sample failed after all. Queue the sample again, or fail it once its
    budget is spent; returns the state it went to."""
    attempts, number = session.execute(select(SampleRow.attempts, SampleRow.tries).where(SampleRow.pk == pk)).one()
    final = attempts >= max_attempts
    session.execute(
        update(AttemptRow)
        .where(AttemptRow.sample_pk == pk, AttemptRow.number == number)
        .values(outcome="failed" if final else "retry", reason=reason)
    )
    dst = SampleState.FAILED if final else _requeue_state(session, job_id)
    values = {"last_error": reason, "staged_path": None}
    if not final:
        values["writer"] = None
    if _transition(session, job_id, [pk], SampleState.STAGED, dst, values) != 1:
        raise RuntimeError(f"sample {pk} left the staged state while its shard was written")
    return dst


def reserve_shard_number(session: Session, job_id: str) -> int:
    return (
        session.execute(
            update(JobRow)
            .where(JobRow.id == job_id)
            .values(shards_written=JobRow.shards_written + 1)
            .returning(JobRow.shards_written)
        ).scalar_one()
        - 1
    )


def commit_shard(
    session: Session, job_id: str, *, name: str, nbytes: int, sha256: str, placed: list[tuple[int, int, int]]
) -> None:
    """Record a written shard and mark its samples succeeded. `placed`: (pk, offset, tokens)."""
    session.execute(
        insert(ShardRow).values(
            job_id=job_id,
            name=name,
            bytes=nbytes,
            sha256=sha256,
            num_samples=len(placed),
            num_tokens=sum(t for _, _, t in placed),
            created_at=utcnow(),
        )
    )
    # In parts, each within any database's limit on parameters (three a sample: pk twice, offset).
    for start in range(0, len(placed), PKS_PER_QUERY // 2):
        part = placed[start : start + PKS_PER_QUERY // 2]
        moved = _transition(
            session,
            job_id,
            [pk for pk, _, _ in part],
            SampleState.STAGED,
            SampleState.SUCCEEDED,
            {"shard": name, "staged_path": None},
            per_sample={"shard_offset": {pk: offset for pk, offset, _ in part}},
        )
        if moved != len(part):
            raise RuntimeError(f"job {job_id}: {len(part) - moved} samples left the staged state during {name}")


# --- reads for the API ----------------------------------------------------------------------


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
    return list(session.execute(select(ShardRow).where(ShardRow.job_id == job_id).order_by(ShardRow.name)).scalars())


def get_shard(session: Session, job_id: str, name: str) -> ShardRow | None:
    if not (could_be_stored(job_id) and could_be_stored(name)):
        return None
    return session.execute(
        select(ShardRow).where(ShardRow.job_id == job_id, ShardRow.name == name)
    ).scalar_one_or_none()


def iter_stored_samples(session: Session, job_id: str, batch: int = 10000):
    """(sample_id, shard, offset, num_tokens, identity) of every stored sample, in job order, in batches."""
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
            )
            .where(SampleRow.job_id == job_id, SampleRow.state == SampleState.SUCCEEDED, SampleRow.idx > last)
            .order_by(SampleRow.idx)
            .limit(batch)
        ).all()
        if not rows:
            return
        yield from rows
        last = rows[-1].idx


# --- throughput -------------------------------------------------------------------------------

THROUGHPUT_BUCKET_S = 5


def _count_throughput(session: Session, job_id: str, *, samples: int, tokens: int) -> None:
    """Add to the job's bucket for now. Callers hold the job's row lock (_transition takes it), so no
    other transaction can insert the same bucket between the UPDATE and the INSERT."""
    start = int(time.time()) // THROUGHPUT_BUCKET_S * THROUGHPUT_BUCKET_S
    params = {"p_job": job_id, "p_start": start, "p_samples": samples, "p_tokens": tokens}
    added, first = _throughput_count()
    if _rowcount(session.execute(added, params)) == 0:
        session.execute(first, params)


@functools.cache
def _throughput_count():
    """(add to an existing bucket, start a new one)."""
    row = (_throughput.c.job_id == bindparam("p_job"), _throughput.c.bucket_start == bindparam("p_start"))
    added = (
        update(_throughput)
        .where(*row)
        .values(
            samples=_throughput.c.samples + bindparam("p_samples"), tokens=_throughput.c.tokens + bindparam("p_tokens")
        )
    )
    first = insert(_throughput).values(
        job_id=bindparam("p_job"),
        bucket_start=bindparam("p_start"),
        samples=bindparam("p_samples"),
        tokens=bindparam("p_tokens"),
    )
    return added, first


@dataclass(frozen=True)
class ThroughputPoint:
    start: int  # Unix seconds
    seconds: float  # how much of the window the job was running
    samples: int
    tokens: int


def job_throughput(session: Session, job: JobRow, *, points: int, now: float) -> tuple[int, list[ThroughputPoint]]:
    """What the job extracted over time, in at most `points` windows of equal width (a multiple of
    THROUGHPUT_BUCKET_S), from its first extraction to its end (or `now`); windows without any are
    there with zeros. Returns (width in seconds, points)."""
    first, last = session.execute(
        select(func.min(ThroughputRow.bucket_start), func.max(ThroughputRow.bucket_start)).where(
            ThroughputRow.job_id == job.id
        )
    ).one()
    if first is None:
        return THROUGHPUT_BUCKET_S, []
    started = _epoch(job.started_at) if job.started_at is not None else first
    stop = _epoch(job.finished_at) if job.finished_at is not None else now
    span = max(last + THROUGHPUT_BUCKET_S, stop) - first
    width = THROUGHPUT_BUCKET_S * max(1, math.ceil(span / (THROUGHPUT_BUCKET_S * points)))
    window = (ThroughputRow.bucket_start - first) // width
    sums = {
        int(i): (int(n), int(t))
        for i, n, t in session.execute(
            select(window, func.sum(ThroughputRow.samples), func.sum(ThroughputRow.tokens))
            .where(ThroughputRow.job_id == job.id)
            .group_by(window)
        ).all()
    }
    out = []
    for i in range(math.ceil(span / width)):
        start = first + i * width
        seconds = max(0.0, min(start + width, stop) - max(start, started))
        samples, tokens = sums.get(i, (0, 0))
        out.append(ThroughputPoint(start, seconds, samples, tokens))
    return width, out


def _epoch(dt: datetime) -> float:
    # SQLite hands back naive datetimes; every stored time is UTC.
    return (dt if dt.tzinfo is not None else dt.replace(tzinfo=timezone.utc)).timestamp()


# --- the output root --------------------------------------------------------------------------


def recorded_output_root(session: Session) -> OutputRootRow | None:
    """The output root the database's jobs write to, once a service has recorded it."""
    return session.execute(select(OutputRootRow).where(OutputRootRow.pk == 1)).scalar_one_or_none()


def record_output_root(session: Session, root_id: str, location: str) -> OutputRootRow:
    """Record the output root unless one is recorded already (by a racing service too); returns
    the one recorded."""
    existing = recorded_output_root(session)
    if existing is not None:
        return existing
    try:
        with session.begin_nested():
            session.add(OutputRootRow(pk=1, root_id=root_id, location=location, recorded_at=utcnow()))
    except IntegrityError:
        pass  # another service recorded its root first
    recorded = recorded_output_root(session)
    assert recorded is not None
    return recorded


# --- writers ----------------------------------------------------------------------------------

WRITER_STALE_S = 30.0


class LeaseLost(Exception):
    """This writer's lease expired or was taken over: nothing it does under that lease may be recorded."""

    def __init__(self, message: str, epoch: int):
        super().__init__(message)
        self.epoch = epoch


def _lease_until(lease_s: float) -> datetime:
    return utcnow() + timedelta(seconds=lease_s)


def register_writer(session: Session, identity: str, *, lease_s: float, started_at: datetime, staged_exists) -> int:
    """Start (or restart) a writer's lease and return its new fencing token.

    In the same transaction, whatever the writer left under an earlier token is settled as at a
    restart: its running samples go back to the queue unspent, its staged ones too unless their
    files are still here (recover_writer). Writes fenced by an older token fail from now on."""
    row = session.execute(
        select(WriterRow).where(WriterRow.identity == identity).with_for_update()
    ).scalar_one_or_none()
    now = utcnow()
    if row is None:
        row = WriterRow(identity=identity, state="starting", started_at=started_at, heartbeat_at=now, epoch=0)
        session.add(row)
    row.epoch = (row.epoch or 0) + 1
    row.state, row.reason = "starting", None
    row.lease_expires_at = _lease_until(lease_s)
    row.heartbeat_at = now
    row.started_at = started_at
    session.flush()
    recover_writer(session, identity, staged_exists, why="the writer restarted or lost its lease during the attempt")
    return row.epoch


def check_lease(session: Session, identity: str, epoch: int) -> None:
    """The fence: a writer's transaction records its work only while the lease it worked under is
    current. Taken first in the transaction. On Postgres it holds FOR KEY SHARE on the writer's row:
    a takeover (FOR UPDATE) waits for transactions already past the check, while the heartbeat's
    renewal (an UPDATE of no key column) does not wait for them."""
    lease = {"p_identity": identity, "p_epoch": epoch, "p_now": utcnow()}
    if session.execute(_lease_check(_dialect(session)), lease).first() is None:
        raise LeaseLost(f"writer {identity}: lease {epoch} is no longer current", epoch)


@functools.cache
def _lease_check(dialect: str):
    q = select(_writers.c.epoch).where(
        _writers.c.identity == bindparam("p_identity"),
        _writers.c.epoch == bindparam("p_epoch"),
        _writers.c.lease_expires_at > _now_param(),
    )
    return q.with_for_update(read=True, key_share=True) if dialect == "postgresql" else q


def renew_lease(
    session: Session,
    identity: str,
    epoch: int,
    *,
    lease_s: float,
    state: str,
    reason: str | None,
    server: dict | None,
    stats: dict | None,
) -> None:
    """The heartbeat: extend the lease and report the writer's status; LeaseLost when it is gone."""
    renewed = session.execute(
        update(WriterRow)
        .where(WriterRow.identity == identity, WriterRow.epoch == epoch, WriterRow.lease_expires_at > utcnow())
        .values(
            state=state,
            reason=reason,
            server=server,
            stats=stats,
            heartbeat_at=utcnow(),
            lease_expires_at=_lease_until(lease_s),
        )
    )
    if _rowcount(renewed) == 0:
        raise LeaseLost(f"writer {identity}: lease {epoch} expired or was taken over", epoch)


def report_writer_stopped(session: Session, identity: str, epoch: int) -> None:
    """A writer stopping on purpose ends its lease at once: nothing of it is left to take over."""
    session.execute(
        update(WriterRow)
        .where(WriterRow.identity == identity, WriterRow.epoch == epoch)
        .values(state="stopped", reason=None, heartbeat_at=utcnow(), lease_expires_at=utcnow())
    )


def expire_leases(session: Session) -> list[tuple[str, int]]:
    """Take over the work of writers whose lease ran out: fence them (a new token they do not hold)
    and give their running and staged samples back to the queue without spending an attempt (a
    staged dump lives on a disk no other writer reads). Returns (identity, samples requeued) for
    each writer taken over."""
    # A writer that stopped on purpose is taken over too: it may never start again, and what it
    # staged waits on its own disk (if it does start, it loses only the re-extraction of those).
    q = select(WriterRow).where(WriterRow.lease_expires_at < utcnow(), WriterRow.state != "lost")
    if session.get_bind().dialect.name == "postgresql":
        q = q.with_for_update(skip_locked=True)
    taken = []
    for row in session.execute(q).scalars().all():
        row.epoch += 1
        row.state, row.reason = "lost", f"lease expired at {row.lease_expires_at}; its samples went back to the queue"
        why = "the writer's lease expired during the attempt"
        requeued, _ = recover_writer(session, row.identity, lambda _: False, why=why)
        taken.append((row.identity, requeued))
    return taken


def all_writers(session: Session) -> list[WriterRow]:
    return list(session.execute(select(WriterRow).order_by(WriterRow.identity)).scalars())


def live_writers(session: Session) -> list[WriterRow]:
    since = datetime.fromtimestamp(time.time() - WRITER_STALE_S, timezone.utc)
    return list(
        session.execute(select(WriterRow).where(WriterRow.heartbeat_at >= since).order_by(WriterRow.identity)).scalars()
    )


def waiting(session: Session) -> Waiting:
    """Why active jobs make no progress, job by job (hsx.matching.Waiting)."""
    return Waiting(live_writers(session))

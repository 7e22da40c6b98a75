"""Jobs: creating one with its samples, and what is done to a job as a whole (cancel, retry, delete,
fail, finish)."""

from __future__ import annotations

import re
import secrets
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import case, delete, func, select, update
from sqlalchemy.orm import Session

from hsx.db.models import AttemptCountRow, AttemptRow, JobRow, SampleRow, ShardRow, ThroughputRow
from hsx.db.repository._base import rowcount, utcnow
from hsx.db.repository.transitions import ALL, lock_job, transition
from hsx.matching import Serves, choice_key, layers_key
from hsx.names import JOB_ID_FORM
from hsx.states import ACTIVE_JOB_STATES, TERMINAL_JOB_STATES, JobState, SampleState

if TYPE_CHECKING:
    import psycopg


def new_job_id() -> str:
    # Time-ordered so that ids sort by creation: cursor pagination and claim order rely on it (JOB_ID_FORM).
    return f"job_{int(time.time() * 1000):012x}{secrets.token_hex(4)}"


_JOB_ID = re.compile(JOB_ID_FORM)


def is_job_id(text: str) -> bool:
    """Whether `text` has the form new_job_id gives every job id (and so every job folder's name)."""
    return _JOB_ID.fullmatch(text) is not None


@dataclass(frozen=True)
class NewSample:
    sample_id: str
    input_ids: bytes  # little-endian int32; empty for a conversation to prepare or a skipped sample
    loss_mask: bytes | None  # one byte per token; None means all ones
    num_tokens: int
    # queued (token ids), preparing (a conversation, rendered later) or skipped (why: `reason`)
    state: SampleState = SampleState.QUEUED
    conversation: str | None = None  # the turns as JSON
    reason: str | None = None
    truncated_from: int | None = None  # its token count before the length policy cut it


_SAMPLE_INSERT_COLUMNS = (
    "job_id",
    "idx",
    "sample_id",
    "state",
    "input_ids",
    "loss_mask",
    "num_tokens",
    "conversation",
    "last_error",
    "truncated_from",
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
        layers: list[int] | str | None,
        idempotency_key: str | None = None,
        request_sha256: str | None = None,
        options: dict[str, Any] | None = None,
    ):
        self.session = session
        self.job = JobRow(
            id=new_job_id(),
            name=name,
            state=JobState.QUEUED,
            created_at=utcnow(),
            layers=layers if isinstance(layers, list) else None,
            layers_key=None if layers is None else choice_key(layers),
            options=options or None,
            idempotency_key=idempotency_key,
            request_sha256=request_sha256,
            num_samples=0,
            tokens_total=0,
            tokens_done=0,
            tokens_staged=0,
            n_preparing=0,
            n_queued=0,
            n_running=0,
            n_staged=0,
            n_succeeded=0,
            n_failed=0,
            n_cancelled=0,
            n_skipped=0,
            n_truncated=0,
            n_requeued=0,
            shards_written=0,
        )
        session.add(self.job)
        session.flush()
        self.count = 0
        self.tokens = 0
        self.truncated = 0
        self.states: Counter[SampleState] = Counter()

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
            (
                job_id,
                first + i,
                s.sample_id,
                s.state,
                s.input_ids,
                s.loss_mask,
                s.num_tokens,
                s.conversation,
                s.reason,
                s.truncated_from,
                0,
                0,
                now,
            )
            for i, s in enumerate(samples)
        ]
        columns = ", ".join(_SAMPLE_INSERT_COLUMNS)
        if conn.dialect.name == "postgresql":
            # COPY is psycopg's, not the DB-API's; make_engine always picks psycopg for Postgres.
            driver = cast("psycopg.Connection[Any]", conn.connection.driver_connection)
            with driver.cursor() as cursor, cursor.copy(f"COPY samples ({columns}) FROM STDIN") as copy:
                for row in rows:
                    copy.write_row(row)
        else:
            marks = ", ".join("?" * len(_SAMPLE_INSERT_COLUMNS))
            conn.exec_driver_sql(f"INSERT INTO samples ({columns}) VALUES ({marks})", rows)
        self.count += len(samples)
        self.tokens += sum(s.num_tokens for s in samples if s.state == SampleState.QUEUED)
        self.states.update(s.state for s in samples)
        self.truncated += sum(1 for s in samples if s.truncated_from is not None)

    def finish(self) -> JobRow:
        self.job.num_samples = self.count
        self.job.n_queued = self.states[SampleState.QUEUED]
        self.job.n_preparing = self.states[SampleState.PREPARING]
        self.job.n_skipped = self.states[SampleState.SKIPPED]
        self.job.n_truncated = self.truncated
        self.job.tokens_total = self.tokens
        self.session.flush()
        return self.job


def create_job(
    session: Session, *, name: str | None, layers: list[int] | str | None, samples: list[NewSample]
) -> JobRow:
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


def cancel_job(session: Session, job_id: str) -> JobRow | None:
    """Mark the job cancelling: no sample of it is claimed from now on, and its queued samples are
    cancelled afterwards, batch by batch (cancel_queued), so that the request answers at once
    whatever the job's size; running or staged ones finish and are stored. Returns None when the
    job is not queued or running (finished, or already cancelling)."""
    job = lock_job(session, job_id)
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
    job = lock_job(session, job_id)
    if job is None or job.state != JobState.CANCELLING:
        return 0
    if job.n_preparing:
        # Conversations not yet prepared are cancelled at once (a preparer's claim included: what it
        # stores afterwards finds them gone); they hold no tokens to count.
        return transition(session, job_id, ALL, SampleState.PREPARING, SampleState.CANCELLED, {"writer": None})
    if not job.n_queued:
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
    return transition(
        session, job_id, ALL, SampleState.QUEUED, SampleState.CANCELLED, {"writer": None}, through_idx=last
    )


# What a retry queues again: the samples a job has not stored and did not leave out by its policy.
RETRIED = (SampleState.FAILED, SampleState.CANCELLED)


def retry_job(session: Session, job_id: str) -> int | None:
    """Queue again what the job has not stored: its failed samples and, for a cancelled job, those the
    cancel left unrun, each with a fresh attempt budget (conversations never rendered are prepared again).
    Its stored and skipped samples stay as they are, so the job goes on: its next shard takes the next
    number and the next feed position. Returns how many went back; None when not allowed now (the job is
    being cancelled, or has nothing to queue again)."""
    job = lock_job(session, job_id)
    if job is None or job.state == JobState.CANCELLING or not (job.n_failed or job.n_cancelled):
        return None
    moved = 0
    for state in RETRIED:
        # Conversations that never had token ids (cancelled or failed before, or in, their preparation)
        # go back to their preparation.
        unprepared = SampleRow.num_tokens == 0
        fresh = {"attempts": 0, "writer": None, "last_error": None}
        moved += transition(session, job_id, ALL, state, SampleState.PREPARING, fresh, where=unprepared)
        moved += transition(session, job_id, ALL, state, SampleState.QUEUED, {"attempts": 0, "writer": None})
    session.execute(
        update(JobRow)
        .where(JobRow.id == job_id)
        .values(
            state=case((JobRow.started_at.is_(None), JobState.QUEUED), else_=JobState.RUNNING),
            finished_at=None,
            cancel_requested_at=None,
            error=None,
        )
    )
    return moved


def delete_job(session: Session, job_id: str) -> bool | None:
    """Delete a finished job's rows. None: not found; False: not finished yet."""
    job = lock_job(session, job_id)
    if job is None:
        return None
    if job.state not in TERMINAL_JOB_STATES:
        return False
    sample_pks = select(SampleRow.pk).where(SampleRow.job_id == job_id)
    session.execute(delete(AttemptRow).where(AttemptRow.sample_pk.in_(sample_pks)))
    session.execute(delete(SampleRow).where(SampleRow.job_id == job_id))
    session.execute(delete(ShardRow).where(ShardRow.job_id == job_id))
    session.execute(delete(ThroughputRow).where(ThroughputRow.job_id == job_id))
    session.execute(delete(AttemptCountRow).where(AttemptCountRow.job_id == job_id))
    session.execute(delete(JobRow).where(JobRow.id == job_id))
    return True


def set_job_model_info(session: Session, job_id: str, info: dict[str, Any], serves: Serves) -> dict[str, Any]:
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
    """The state a job ends in once nothing is preparing, queued, running or staged; None before that.
    succeeded: every sample not skipped is stored; partial: some stored, some failed; failed: none
    stored (all failed or skipped)."""
    if job.state not in ACTIVE_JOB_STATES or job.n_preparing or job.n_queued or job.n_running or job.n_staged:
        return None
    if job.state == JobState.CANCELLING:
        return JobState.CANCELLED
    if not job.n_succeeded:
        return JobState.FAILED
    return JobState.PARTIAL if job.n_failed else JobState.SUCCEEDED


def _nothing_stored(session: Session, job: JobRow) -> str:
    """Why a job that ends failed stored nothing: its own error, else what its samples say."""
    if job.error:
        return job.error
    if not job.n_failed:
        return f"no sample to extract: all {job.num_samples} were skipped (see each sample's reason)"
    first = session.execute(
        select(SampleRow.sample_id, SampleRow.last_error)
        .where(SampleRow.job_id == job.id, SampleRow.state == SampleState.FAILED)
        .order_by(SampleRow.idx)
        .limit(1)
    ).first()
    skipped = f" and {job.n_skipped} skipped" if job.n_skipped else ""
    which = f"; the first, {first.sample_id}: {first.last_error}" if first is not None else ""
    return f"nothing stored: {job.n_failed} failed{skipped} (see each sample's reason){which}"


def finish_job_if_done(session: Session, job_id: str) -> bool:
    """Move a job to its terminal state (final_state's rule) once no sample is preparing, queued, running or staged."""
    job = lock_job(session, job_id)
    if job is None:
        return False
    state = final_state(job)
    if state is None:
        return False
    error = _nothing_stored(session, job) if state == JobState.FAILED else job.error
    result = session.execute(
        update(JobRow)
        .where(
            JobRow.id == job_id,
            JobRow.state == job.state,
            JobRow.n_preparing == 0,
            JobRow.n_queued == 0,
            JobRow.n_running == 0,
            JobRow.n_staged == 0,
        )
        .values(state=state, finished_at=utcnow(), error=error)
    )
    return rowcount(result) == 1


def warn_job(session: Session, job_id: str, warning: str) -> None:
    """Say on the job what it runs without that it asked for; the first warning stays."""
    session.execute(update(JobRow).where(JobRow.id == job_id, JobRow.warning.is_(None)).values(warning=warning))


def fail_job(session: Session, job_id: str, reason: str) -> None:
    """A job that cannot run at all (e.g. server settings that break dumps, a tokenizer that cannot be
    loaded): fail what is queued or waiting to be prepared."""
    session.execute(update(JobRow).where(JobRow.id == job_id).values(error=reason))
    for state in (SampleState.PREPARING, SampleState.QUEUED):
        transition(session, job_id, ALL, state, SampleState.FAILED, {"last_error": reason, "writer": None})

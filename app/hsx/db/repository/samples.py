"""A writer's samples: claiming the next one, its attempts and their outcomes, what it staged, and what
it left behind when it stopped."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    BigInteger,
    BindParameter,
    ColumnElement,
    Select,
    Update,
    and_,
    bindparam,
    case,
    exists,
    func,
    insert,
    or_,
    select,
    update,
)
from sqlalchemy.orm import Session

from hsx.db.models import AttemptRow, SampleRow
from hsx.db.repository._base import ATTEMPTS, JOBS, PKS_PER_QUERY, SAMPLES, dialect_of, now_param, utcnow
from hsx.db.repository.attempts import count_attempt
from hsx.db.repository.preparing import release_preparing
from hsx.db.repository.throughput import count_throughput
from hsx.db.repository.transitions import requeue_state, transition
from hsx.matching import Serves
from hsx.states import JobState, SampleState


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
    job_model_info: dict[str, Any] | None
    job_layers_key: str | None  # the layers it asks for: a list's key, a set's name, None for any
    queued_left: int = 0  # the job's samples still queued after this claim


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
    statements = _claim(dialect_of(session), serves.layers is not None, serves.model is not None)
    now = utcnow()
    params = {
        "p_writer": writer,
        "p_now": now,
        "p_keys": served_keys(session, serves) if serves.layers is not None else [],
        "p_model": serves.model,
    }
    job_id = session.execute(statements.job, params).scalar()
    if job_id is None:
        return None
    params["p_job"] = job_id
    row = session.execute(statements.sample, params).first()
    if row is None:
        return None
    params["p_retried"] = int(row.tries > 1)  # it was tried before: one queued sample less waits for a retry
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
        job.layers_key,
        job.n_queued,
    )


def served_keys(session: Session, serves: Serves) -> list[str]:
    """The layers keys of the active jobs that a worker serving `serves` may claim from: whether a key is
    served takes the worker's model (its depth, its side of the final norm) and is decided in Python
    (hsx.matching.Serves.gives), so the claim filters on plain equality with these, the same on every
    database. There are few active jobs, and fewer distinct keys."""
    return [key for key in session.execute(_active_keys()).scalars() if serves.gives(key)]


@functools.cache
def _active_keys() -> Select[Any]:
    active = (JobState.QUEUED, JobState.RUNNING)
    return select(JOBS.c.layers_key).where(JOBS.c.state.in_(active), JOBS.c.layers_key.is_not(None)).distinct()


@dataclass(frozen=True)
class _ClaimStatements:
    job: Any  # the oldest job the worker may claim from that has a queued sample, locked
    sample: Any  # that job's first queued sample, now running for the writer unless it runs one
    counters: Any  # the job's counters (and state: running from its first claim), returning what the claim needs
    attempt: Any  # the attempt's row


def in_flight_bytes() -> ColumnElement[Any]:
    """About the bytes a job's staged and running samples will add to its shards: its estimate per token
    times its staged tokens, per sample times its running samples (0 where it has no estimate: a
    conversation job's size is known only once rendered)."""
    per_token = JOBS.c.estimated_bytes // func.nullif(JOBS.c.tokens_total, 0, type_=BigInteger)
    per_sample = JOBS.c.estimated_bytes // func.nullif(JOBS.c.num_samples, 0, type_=BigInteger)
    return func.coalesce(per_token * JOBS.c.tokens_staged, 0) + func.coalesce(per_sample * JOBS.c.n_running, 0)


def held_back() -> ColumnElement[bool]:
    """A job whose consumers have not read enough (JobOptions.max_unread_bytes): its unread shards and
    what is in flight reach its limit, so writers claim none of its samples until they read more."""
    return and_(
        JOBS.c.max_unread_bytes.is_not(None), JOBS.c.unread_bytes + in_flight_bytes() >= JOBS.c.max_unread_bytes
    )


def held_back_jobs(session: Session, job_ids: list[str]) -> set[str]:
    """Which of these jobs wait for their consumers to read (see held_back)."""
    if not job_ids:
        return set()
    return set(session.execute(select(JOBS.c.id).where(JOBS.c.id.in_(job_ids), held_back())).scalars())


@functools.cache
def _claim(dialect: str, by_layers: bool, by_model: bool) -> _ClaimStatements:
    # The queued rows themselves, not the n_queued counter, say whether a job has work: a job can
    # never be picked for nothing while another waits.
    has_queued = exists().where(SAMPLES.c.job_id == JOBS.c.id, SAMPLES.c.state == SampleState.QUEUED)
    # hsx.matching: jobs of no key yet, or of a key the worker serves (served_keys)
    runs_on = []
    if by_layers:
        keys: BindParameter[list[str]] = bindparam("p_keys", expanding=True)
        runs_on.append(or_(JOBS.c.layers_key.is_(None), JOBS.c.layers_key.in_(keys)))
    if by_model:
        runs_on.append(or_(JOBS.c.model_key.is_(None), JOBS.c.model_key == bindparam("p_model")))
    job = (
        select(JOBS.c.id)
        .where(JOBS.c.state.in_((JobState.QUEUED, JobState.RUNNING)), *runs_on, has_queued, ~held_back())
        .order_by(JOBS.c.id)
        .limit(1)
        .with_for_update(of=JOBS)
    )
    pick = (
        select(SAMPLES.c.pk)
        .where(SAMPLES.c.job_id == bindparam("p_job"), SAMPLES.c.state == SampleState.QUEUED)
        .order_by(SAMPLES.c.idx)
        .limit(1)
    )
    if dialect == "postgresql":
        pick = pick.with_for_update(skip_locked=True)
    other = SAMPLES.alias("other")
    busy = exists().where(other.c.state == SampleState.RUNNING, other.c.writer == bindparam("p_writer"))
    sample = (
        update(SAMPLES)
        .where(SAMPLES.c.pk == pick.scalar_subquery(), SAMPLES.c.state == SampleState.QUEUED, ~busy)
        .values(
            state=SampleState.RUNNING,
            writer=bindparam("p_writer"),
            attempts=SAMPLES.c.attempts + 1,
            tries=SAMPLES.c.tries + 1,
            updated_at=now_param(),
        )
        .returning(
            SAMPLES.c.pk,
            SAMPLES.c.idx,
            SAMPLES.c.sample_id,
            SAMPLES.c.input_ids,
            SAMPLES.c.loss_mask,
            SAMPLES.c.num_tokens,
            SAMPLES.c.attempts,
            SAMPLES.c.tries,
        )
    )
    first = JOBS.c.state == JobState.QUEUED
    counters = (
        update(JOBS)
        .where(JOBS.c.id == bindparam("p_job"))
        .values(
            n_queued=JOBS.c.n_queued - 1,
            n_requeued=JOBS.c.n_requeued - bindparam("p_retried"),
            n_running=JOBS.c.n_running + 1,
            state=case((first, JobState.RUNNING), else_=JOBS.c.state),
            started_at=case((first, now_param()), else_=JOBS.c.started_at),
        )
        .returning(JOBS.c.n_queued, JOBS.c.layers, JOBS.c.layers_key, JOBS.c.model_info)
    )
    attempt = (
        insert(ATTEMPTS)
        .values(
            sample_pk=bindparam("p_pk"),
            number=bindparam("p_number"),
            writer=bindparam("p_writer"),
            started_at=now_param(),
        )
        .returning(ATTEMPTS.c.pk)
    )
    return _ClaimStatements(job, sample, counters, attempt)


def _close_attempt(session: Session, attempt_pk: int, outcome: str, reason: str | None = None, **fields: Any) -> None:
    params = {"p_pk": attempt_pk, "p_outcome": outcome, "p_reason": reason, "p_now": utcnow()}
    session.execute(_attempt_close(tuple(sorted(fields))), params | {f"v_{k}": v for k, v in fields.items()})


@functools.cache
def _attempt_close(columns: tuple[str, ...]) -> Update:
    return (
        update(ATTEMPTS)
        .where(ATTEMPTS.c.pk == bindparam("p_pk"))
        .values(
            outcome=bindparam("p_outcome"),
            reason=bindparam("p_reason"),
            finished_at=now_param(),
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
    moved = transition(
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
        count_throughput(session, c.job_id, samples=1, tokens=observed_tokens)
        count_attempt(session, c.job_id, "ok", None)
    return moved == 1


def queued_left(session: Session, job_id: str) -> int:
    """How many of the job's samples are queued (0 for a job that is gone)."""
    return session.execute(_queued_count(), {"p_job": job_id}).scalar() or 0


@functools.cache
def _queued_count() -> Select[Any]:
    return select(JOBS.c.n_queued).where(JOBS.c.id == bindparam("p_job"))


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
    outcome = "failed" if final else "retry"
    _close_attempt(
        session,
        c.attempt_pk,
        outcome,
        reason,
        observed_tokens=observed_tokens,
        dump_key=dump_key,
        boot_id=boot_id,
    )
    dst = SampleState.FAILED if final else requeue_state(session, c.job_id)
    values = {"last_error": reason, "observed_tokens": observed_tokens}
    if not final:
        values["writer"] = None
    if transition(session, c.job_id, [c.sample_pk], SampleState.RUNNING, dst, values):
        count_attempt(session, c.job_id, outcome, reason)
    return dst


def release_interrupted(session: Session, c: Claimed, *, reason: str) -> None:
    """Give the sample back without spending an attempt: the server, not the sample, failed."""
    _close_attempt(session, c.attempt_pk, "interrupted", reason)
    if transition(
        session,
        c.job_id,
        [c.sample_pk],
        SampleState.RUNNING,
        requeue_state(session, c.job_id),
        {"writer": None, "attempts": SampleRow.attempts - 1, "last_error": reason},
    ):
        count_attempt(session, c.job_id, "interrupted", reason)


def _writer_or_slots(writer: str) -> ColumnElement[bool]:
    """The writer itself or any of its in-flight slots ("<writer>#<n>")."""
    return or_(SampleRow.writer == writer, SampleRow.writer.startswith(writer + "#", autoescape=True))


def recover_writer(
    session: Session,
    writer: str,
    staged_exists: Callable[[str], bool],
    *,
    why: str = "service stopped during the attempt",
) -> tuple[int, int]:
    """At writer start: its running samples were interrupted by a crash; staged ones keep their
    place only if their staged files survived; conversations it was preparing go back to be
    claimed by any preparer. Returns (requeued, kept staged)."""
    release_preparing(session, writer)
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
        moved = transition(
            session,
            job_id,
            [pk],
            SampleState.RUNNING,
            requeue_state(session, job_id),
            {"writer": None, "attempts": SampleRow.attempts - 1},
        )
        if moved:
            count_attempt(session, job_id, "interrupted", why)
        requeued += moved
    staged = session.execute(
        select(SampleRow.pk, SampleRow.job_id, SampleRow.staged_path).where(
            SampleRow.writer == writer, SampleRow.state == SampleState.STAGED
        )
    ).all()
    for pk, job_id, path in staged:
        if path and staged_exists(path):
            kept += 1
        else:
            requeued += transition(
                session,
                job_id,
                [pk],
                SampleState.STAGED,
                requeue_state(session, job_id),
                {
                    "writer": None,
                    "staged_path": None,
                    "attempts": SampleRow.attempts - 1,
                    "last_error": "staged dump was lost before its shard was written",
                },
            )
    return requeued, kept


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
    transition(
        session,
        job_id,
        pks,
        SampleState.STAGED,
        requeue_state(session, job_id),
        {"writer": None, "staged_path": None, "last_error": reason},
    )


def reject_staged(session: Session, job_id: str, pk: int, *, reason: str, max_attempts: int) -> SampleState:
    """Writing the shard found what staging does not check (NaN or Inf among the values): the
    attempt that staged the sample failed after all. Queue the sample again, or fail it once its
    budget is spent; returns the state it went to."""
    attempts, number = session.execute(select(SampleRow.attempts, SampleRow.tries).where(SampleRow.pk == pk)).one()
    final = attempts >= max_attempts
    outcome = "failed" if final else "retry"
    session.execute(
        update(AttemptRow)
        .where(AttemptRow.sample_pk == pk, AttemptRow.number == number)
        .values(outcome=outcome, reason=reason)
    )
    dst = SampleState.FAILED if final else requeue_state(session, job_id)
    values = {"last_error": reason, "staged_path": None}
    if not final:
        values["writer"] = None
    if transition(session, job_id, [pk], SampleState.STAGED, dst, values) != 1:
        raise RuntimeError(f"sample {pk} left the staged state while its shard was written")
    # The attempt that staged it counted as ok: it counts under its new outcome now.
    count_attempt(session, job_id, "ok", None, -1)
    count_attempt(session, job_id, outcome, reason)
    return dst

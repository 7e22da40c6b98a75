"""Conversation samples on their way to the queue: a writer's preparer claims a batch of a job's
`preparing` samples, renders (and regenerates) them outside any transaction, then stores what came
out: queued with their token ids, skipped by the job's length policy, or failed with the reason.

A claim is the writer's identity in the sample's `writer` column. A writer that restarts, or whose
lease another takes over, releases its claims (recover_writer): the batch is prepared again, by
whichever preparer gets to it first."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from hsx.db.models import JobRow, SampleRow
from hsx.db.repository._base import dialect_of as _dialect
from hsx.db.repository.transitions import transition as _transition
from hsx.states import JobState, SampleState


@dataclass(frozen=True)
class ToPrepare:
    pk: int
    sample_id: str
    conversation: str  # the turns as JSON


@dataclass(frozen=True)
class Prepared:
    """What became of one claimed sample: queued (ids, mask), skipped or failed (reason)."""

    pk: int
    state: SampleState
    input_ids: bytes = b""
    loss_mask: bytes | None = None
    num_tokens: int = 0
    conversation: str | None = None  # the regenerated turns, when they were
    reason: str | None = None
    truncated_from: int | None = None  # its token count before the length policy cut it


def jobs_to_prepare(session: Session, model_key: str | None) -> list[tuple[str, dict[str, Any] | None]]:
    """(id, options) of the active jobs with conversations left to prepare, oldest first: those a
    worker of model `model_key` may run (of no model yet, or of that one; hsx.matching)."""
    q = (
        select(JobRow.id, JobRow.options)
        .where(JobRow.state.in_((JobState.QUEUED, JobState.RUNNING)), JobRow.n_preparing > 0)
        .order_by(JobRow.id)
    )
    if model_key is not None:
        q = q.where(or_(JobRow.model_key.is_(None), JobRow.model_key == model_key))
    return [(job_id, options) for job_id, options in session.execute(q).all()]


def pin_job_model(session: Session, job_id: str, model_key: str | None) -> None:
    """A job whose conversations are rendered with its model's own template is that model's from now
    on: only workers of that model prepare or extract it (the key extraction would set anyway, set
    before any sample of it is extracted)."""
    if model_key is not None:
        session.execute(
            update(JobRow).where(JobRow.id == job_id, JobRow.model_key.is_(None)).values(model_key=model_key)
        )


def claim_preparing(session: Session, job_id: str, writer: str, limit: int) -> list[ToPrepare]:
    """Claim up to `limit` of the job's unclaimed preparing samples, in input order, for `writer`."""
    q = (
        select(SampleRow.pk, SampleRow.sample_id, SampleRow.conversation)
        .where(SampleRow.job_id == job_id, SampleRow.state == SampleState.PREPARING, SampleRow.writer.is_(None))
        .order_by(SampleRow.idx)
        .limit(limit)
    )
    if _dialect(session) == "postgresql":
        q = q.with_for_update(skip_locked=True)
    rows = session.execute(q).all()
    if not rows:
        return []
    session.execute(
        update(SampleRow)
        .where(SampleRow.pk.in_([r.pk for r in rows]), SampleRow.state == SampleState.PREPARING)
        .values(writer=writer)
        .execution_options(synchronize_session=False)
    )
    return [ToPrepare(r.pk, r.sample_id, r.conversation or "[]") for r in rows]


def store_prepared(session: Session, job_id: str, writer: str, results: list[Prepared]) -> int:
    """Move each prepared sample still claimed by `writer` to its state, with its ids; the job's
    tokens to extract grow by the queued ones'. Returns how many moved."""
    claimed = set(
        session.execute(
            select(SampleRow.pk).where(
                SampleRow.pk.in_([r.pk for r in results]),
                SampleRow.state == SampleState.PREPARING,
                SampleRow.writer == writer,
            )
        ).scalars()
    )
    moved = 0
    for state in (SampleState.QUEUED, SampleState.SKIPPED, SampleState.FAILED):
        batch = [r for r in results if r.state == state and r.pk in claimed]
        if not batch:
            continue
        per_sample: dict[str, dict[int, Any]] = {
            "input_ids": {r.pk: r.input_ids for r in batch},
            "loss_mask": {r.pk: r.loss_mask for r in batch},
            "num_tokens": {r.pk: r.num_tokens for r in batch},
            "last_error": {r.pk: r.reason for r in batch},
        }
        regenerated = {r.pk: r.conversation for r in batch if r.conversation is not None}
        if regenerated:
            per_sample["conversation"] = regenerated
        cut = {r.pk: r.truncated_from for r in batch if r.truncated_from is not None}
        if cut:
            per_sample["truncated_from"] = cut
        pks = [r.pk for r in batch]
        moved += _transition(
            session, job_id, pks, SampleState.PREPARING, state, {"writer": None}, per_sample=per_sample
        )
        if state == SampleState.QUEUED:
            tokens = sum(r.num_tokens for r in batch)
            session.execute(
                update(JobRow)
                .where(JobRow.id == job_id)
                .values(tokens_total=JobRow.tokens_total + tokens, n_truncated=JobRow.n_truncated + len(cut))
            )
    return moved


def release_preparing(session: Session, writer: str, pks: list[int] | None = None) -> int:
    """Give back the preparing samples `writer` claimed (all of them: it restarted, or its lease was taken
    over; or those of `pks`, which it stopped before preparing)."""
    which = [SampleRow.writer == writer, SampleRow.state == SampleState.PREPARING]
    if pks is not None:
        which.append(SampleRow.pk.in_(pks))
    result = session.execute(
        update(SampleRow).where(*which).values(writer=None).execution_options(synchronize_session=False)
    )
    return int(getattr(result, "rowcount", 0) or 0)

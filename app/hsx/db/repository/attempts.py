"""Each job's attempts counted by outcome and reason code as they end (job_attempt_counts), so that a job's
retries by reason are read from a few rows however many attempts it made."""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import cast

from sqlalchemy import Insert, Table, Update, bindparam, select, update
from sqlalchemy.orm import Session

from hsx.db.models import AttemptCountRow
from hsx.db.repository._base import JOBS, PKS_PER_QUERY, rowcount

_counts = cast(Table, AttemptCountRow.__table__)

REASON_CODE_LENGTH = 100


def reason_code(reason: str | None) -> str:
    """The machine-readable part of an attempt's reason: what precedes its first ':' ("no_dump: ..." is
    no_dump), the whole reason when it has none, "" for none. As /metrics counts attempts, and as
    migration 0008 cut the reasons stored before it."""
    return (reason or "").split(":", 1)[0][:REASON_CODE_LENGTH]


def count_attempt(session: Session, job_id: str, outcome: str, reason: str | None, n: int = 1) -> None:
    """Add `n` (negative: take away) to the job's attempts that ended with `outcome` for `reason`'s code.
    Callers hold the job's row lock (transition takes it), so that no other transaction inserts the
    same row between the UPDATE and the INSERT; the INSERT takes its job from the jobs table, so a job
    deleted meanwhile gets no row."""
    params = {"p_job": job_id, "p_outcome": outcome, "p_reason": reason_code(reason), "p_n": n}
    added, first = _count_statements()
    if rowcount(session.execute(added, params)) == 0 and n > 0:
        session.execute(first, params)


@functools.cache
def _count_statements() -> tuple[Update, Insert]:
    """(add to an existing count, start a new one)."""
    row = (
        _counts.c.job_id == bindparam("p_job"),
        _counts.c.outcome == bindparam("p_outcome"),
        _counts.c.reason == bindparam("p_reason"),
    )
    added = update(_counts).where(*row).values(n=_counts.c.n + bindparam("p_n"))
    job = select(
        JOBS.c.id,
        bindparam("p_outcome", type_=_counts.c.outcome.type),
        bindparam("p_reason", type_=_counts.c.reason.type),
        bindparam("p_n", type_=_counts.c.n.type),
    ).where(JOBS.c.id == bindparam("p_job"))
    first = _counts.insert().from_select(["job_id", "outcome", "reason", "n"], job)
    return added, first


def attempt_counts(session: Session, job_ids: list[str]) -> dict[str, list[tuple[str, str, int]]]:
    """(outcome, reason code, attempts) for each of the jobs, by job id; a job without any ended attempt
    is left out."""
    found: dict[str, list[tuple[str, str, int]]] = defaultdict(list)
    for start in range(0, len(job_ids), PKS_PER_QUERY):
        part = job_ids[start : start + PKS_PER_QUERY]
        rows = session.execute(
            select(_counts.c.job_id, _counts.c.outcome, _counts.c.reason, _counts.c.n)
            .where(_counts.c.job_id.in_(part), _counts.c.n != 0)
            .order_by(_counts.c.job_id, _counts.c.outcome, _counts.c.reason)
        ).all()
        for job_id, outcome, reason, n in rows:
            found[job_id].append((outcome, reason, int(n)))
    return dict(found)

"""What each job extracted over time: counted in buckets as samples are staged, read back in windows."""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from datetime import datetime, timezone

from sqlalchemy import Insert, Update, bindparam, func, insert, select, update
from sqlalchemy.orm import Session

from hsx.db.models import JobRow, ThroughputRow
from hsx.db.repository._base import THROUGHPUT, rowcount

THROUGHPUT_BUCKET_S = 5


def count_throughput(session: Session, job_id: str, *, samples: int, tokens: int) -> None:
    """Add to the job's bucket for now. Callers hold the job's row lock (transition takes it), so no
    other transaction can insert the same bucket between the UPDATE and the INSERT."""
    start = int(time.time()) // THROUGHPUT_BUCKET_S * THROUGHPUT_BUCKET_S
    params = {"p_job": job_id, "p_start": start, "p_samples": samples, "p_tokens": tokens}
    added, first = _throughput_count()
    if rowcount(session.execute(added, params)) == 0:
        session.execute(first, params)


@functools.cache
def _throughput_count() -> tuple[Update, Insert]:
    """(add to an existing bucket, start a new one)."""
    row = (THROUGHPUT.c.job_id == bindparam("p_job"), THROUGHPUT.c.bucket_start == bindparam("p_start"))
    added = (
        update(THROUGHPUT)
        .where(*row)
        .values(
            samples=THROUGHPUT.c.samples + bindparam("p_samples"), tokens=THROUGHPUT.c.tokens + bindparam("p_tokens")
        )
    )
    first = insert(THROUGHPUT).values(
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

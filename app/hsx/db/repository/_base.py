"""What every module of the repository shares: the clock, the tables its prepared statements are built
on, and the size of a query's list of keys."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, cast

from sqlalchemy import BindParameter, CursorResult, DateTime, Result, Table, bindparam
from sqlalchemy.orm import Session

from hsx.db.models import AttemptRow, JobRow, SampleRow, ThroughputRow, WriterRow


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def rowcount(result: Result[Any]) -> int:
    """Rows an UPDATE or DELETE matched (Session.execute types every result as a plain Result)."""
    return cast(CursorResult[Any], result).rowcount


# The per-sample path (claim, stage, shard commit, and the lease check fencing each of their
# transactions) runs thousands of times a minute per writer. Building a SQLAlchemy statement costs
# far more CPU than the database spends running it, so those statements are built once per dialect
# (functools.cache), on the tables rather than the ORM classes, with every value a bind parameter.
JOBS, SAMPLES, ATTEMPTS, WRITERS, THROUGHPUT = (
    cast(Table, row.__table__) for row in (JobRow, SampleRow, AttemptRow, WriterRow, ThroughputRow)
)


def now_param() -> BindParameter[datetime]:
    return bindparam("p_now", type_=DateTime(timezone=True))


def dialect_of(session: Session) -> str:
    return session.get_bind().dialect.name


PKS_PER_QUERY = 500

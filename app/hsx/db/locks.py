"""Locks that make a read-then-write decision hold across every process sharing the database.

SQLite needs none: every writing transaction begins IMMEDIATE (hsx.db.engine), so one runs at a time.
On Postgres two transactions can read the same state and both act on it; a transaction-scoped
advisory lock serializes the few decisions that must see each other's outcome, and is released by
the commit or rollback that ends the transaction.
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.orm import Session

# Advisory lock keys are one bigint namespace per database: "hsx" in ASCII, then the lock's number.
_DISK_BUDGET = 0x687378_0001


def hold_disk_budget(session: Session) -> None:
    """Until this transaction ends, no other job creation checks the output volume: the next one
    sees this job's estimate among the active jobs' pending bytes, instead of both taking the same
    free space."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _DISK_BUDGET})

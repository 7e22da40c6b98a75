"""The output root the database's jobs write to, recorded once."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from hsx.db.models import OutputRootRow
from hsx.db.repository._base import utcnow


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

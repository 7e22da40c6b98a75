"""Writers: their registration, the lease that fences their work, its renewal and takeover, and who is
live."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import Select, bindparam, select, update
from sqlalchemy.orm import Session

from hsx.db.models import WriterRow
from hsx.db.repository._base import WRITERS, dialect_of, now_param, rowcount, utcnow
from hsx.db.repository.samples import recover_writer
from hsx.matching import Waiting, may_take_new

WRITER_STALE_S = 30.0


class LeaseLost(Exception):
    """This writer's lease expired or was taken over: nothing it does under that lease may be recorded."""

    def __init__(self, message: str, epoch: int):
        super().__init__(message)
        self.epoch = epoch


def _lease_until(lease_s: float) -> datetime:
    return utcnow() + timedelta(seconds=lease_s)


def register_writer(
    session: Session,
    identity: str,
    *,
    lease_s: float,
    started_at: datetime,
    staged_exists: Callable[[str], bool],
) -> int:
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
    if session.execute(_lease_check(dialect_of(session)), lease).first() is None:
        raise LeaseLost(f"writer {identity}: lease {epoch} is no longer current", epoch)


@functools.cache
def _lease_check(dialect: str) -> Select[Any]:
    q = select(WRITERS.c.epoch).where(
        WRITERS.c.identity == bindparam("p_identity"),
        WRITERS.c.epoch == bindparam("p_epoch"),
        WRITERS.c.lease_expires_at > now_param(),
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
    server: dict[str, Any] | None,
    stats: dict[str, Any] | None,
    vocab_size: int | None = None,
    max_prompt_tokens: int | None = None,
) -> None:
    """The heartbeat: extend the lease and report the writer's status, with what its model server
    accepts (writer_limits reads them); LeaseLost when it is gone."""
    renewed = session.execute(
        update(WriterRow)
        .where(WriterRow.identity == identity, WriterRow.epoch == epoch, WriterRow.lease_expires_at > utcnow())
        .values(
            state=state,
            reason=reason,
            server=server,
            stats=stats,
            vocab_size=vocab_size,
            max_prompt_tokens=max_prompt_tokens,
            heartbeat_at=utcnow(),
            lease_expires_at=_lease_until(lease_s),
        )
    )
    if rowcount(renewed) == 0:
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


# Writers that report limits but will claim nothing: stopped on purpose, or taken over.
_GONE = ("stopped", "lost")


def writer_limits(session: Session, layers: list[int] | str) -> tuple[int | None, int | None]:
    """(vocabulary size, longest prompt) a new job's samples must keep to: the tightest among the live
    writers that may run it (those whose server gives its `layers`, when it asks for some), each as
    its server said at its last heartbeat; None where none of them says. A job is not yet pinned to a
    model when it is created: any of them may claim its first sample."""
    fitting = [w for w in live_writers(session) if w.state not in _GONE and may_take_new(w, layers)]
    vocab = min((w.vocab_size for w in fitting if w.vocab_size is not None), default=None)
    longest = min((w.max_prompt_tokens for w in fitting if w.max_prompt_tokens is not None), default=None)
    return vocab, longest


def present_writers(session: Session) -> list[WriterRow]:
    """The live writers that are not stopped or lost: those that may take a new job's samples."""
    return [w for w in live_writers(session) if w.state not in _GONE]


def reported_model_paths(session: Session) -> set[str]:
    """The model paths the live writers' servers report (a job may name one as its tokenizer)."""
    paths = ((w.server or {}).get("model_path") for w in live_writers(session) if w.state not in _GONE)
    return {p for p in paths if isinstance(p, str)}


def waiting(session: Session) -> Waiting:
    """Why active jobs make no progress, job by job (hsx.matching.Waiting)."""
    return Waiting(live_writers(session))

"""What the writer says about itself: in memory for /healthz and /metrics, and in the database
(a heartbeat) so that jobs can say why they wait and every process sees every writer."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from hsx.db import repository as repo

if TYPE_CHECKING:
    from hsx.extraction.database import Database

log = logging.getLogger("hsx.writer")

HEARTBEAT_S = 5.0


@dataclass
class WriterStatus:
    state: str = "starting"  # starting | ready | waiting | refusing | stopped
    reason: str | None = None
    since: float = field(default_factory=time.time)
    server: dict | None = None

    def set(self, state: str, reason: str | None = None) -> bool:
        """Returns whether anything changed."""
        if (state, reason) == (self.state, self.reason):
            return False
        self.state, self.reason, self.since = state, reason, time.time()
        if reason:
            log.warning("writer %s: %s", state, reason)
        return True


class StatusReport:
    """Records the writer's status in the database: at once when it changes, else every HEARTBEAT_S."""

    def __init__(self, status: WriterStatus, identity: str, db: Database, rate: Callable[[], float]):
        self.status = status
        self.identity = identity
        self.db = db
        self.rate = rate  # tokens per second lately, reported with each heartbeat
        self.started_at = repo.utcnow()
        self._reported_at = 0.0

    def set(self, state: str, reason: str | None = None) -> None:
        if self.status.set(state, reason):
            self.report()

    def heartbeat(self) -> None:
        if time.monotonic() - self._reported_at >= HEARTBEAT_S:
            self.report()

    def report(self) -> None:
        self._reported_at = time.monotonic()
        self.db.run(
            lambda s: repo.report_writer(
                s,
                self.identity,
                state=self.status.state,
                reason=self.status.reason,
                server=self.status.server,
                started_at=self.started_at,
                tokens_per_s=round(self.rate(), 3),
            )
        )

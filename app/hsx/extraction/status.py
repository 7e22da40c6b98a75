"""What the writer says about itself: in memory for /healthz and /metrics, and in the database
(a heartbeat) so that jobs can say why they wait and every process sees every writer."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hsx.db import repository as repo

if TYPE_CHECKING:
    from hsx.extraction.database import Database
    from hsx.extraction.lease import Lease

log = logging.getLogger("hsx.writer")


@dataclass
class WriterStatus:
    state: str = "starting"  # starting | ready | waiting | refusing | stopped
    reason: str | None = None
    since: float = field(default_factory=time.time)
    server: dict[str, Any] | None = None

    def set(self, state: str, reason: str | None = None) -> bool:
        """Returns whether anything changed."""
        if (state, reason) == (self.state, self.reason):
            return False
        self.state, self.reason, self.since = state, reason, time.time()
        if reason:
            log.warning("writer %s: %s", state, reason)
        return True


class StatusReport:
    """Records the writer's status in the database, renewing its lease: at once when the status
    changes, else from the heartbeat thread every `lease.renew_every_s`."""

    def __init__(self, status: WriterStatus, lease: Lease, db: Database, stats: Callable[[], dict[str, object]]):
        self.status = status
        self.lease = lease
        self.identity = lease.identity
        self.db = db
        self.stats = stats

    def set(self, state: str, reason: str | None = None) -> None:
        if self.status.set(state, reason):
            self.report()

    def report(self) -> None:
        epoch = self.lease.epoch
        if epoch == 0:
            return  # not registered yet: registering reports
        server = self.status.server or {}
        try:
            self.db.run(
                lambda s: repo.renew_lease(
                    s,
                    self.identity,
                    epoch,
                    lease_s=self.lease.lease_s,
                    state=self.status.state,
                    reason=self.status.reason,
                    server=self.status.server,
                    stats=self.stats(),
                    # The server's limits, where an API without a writer of its own checks samples.
                    vocab_size=server.get("vocab_size"),
                    max_prompt_tokens=server.get("max_prompt_tokens"),
                )
            )
        except repo.LeaseLost as exc:
            self.lease.lost(epoch, exc)

    def stopped(self) -> None:
        epoch = self.lease.epoch
        self.db.run(lambda s: repo.report_writer_stopped(s, self.identity, epoch))

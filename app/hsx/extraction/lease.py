"""The writer's lease: several writers share one queue, and one that dies or stalls must not keep
its samples, nor record anything once others have taken them over.

Registering gives the writer a fencing token (the `epoch` of its row in `writers`) and a lease
that heartbeats renew. Every transaction that records the writer's work runs fenced by the token
the work started under (Database.fenced): once the lease has expired or been taken over, those
transactions fail with LeaseLost, whatever the writer was doing. Any writer's heartbeat also takes
over the work of writers whose lease ran out (repository.expire_leases): their running and staged
samples go back to the queue without spending an attempt.

A writer that finds its lease lost drops what it was doing (its in-flight results are refused by
the fence; a staged dump or a shard written under the old token is deleted), logs it and registers
again, which settles what it still held as a restart does.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from hsx.db import repository as repo
from hsx.extraction.database import Database

log = logging.getLogger("hsx.writer")


def staged_exists(path: str) -> bool:
    return (Path(path) / "done").exists()


class Lease:
    def __init__(self, identity: str, lease_s: float, db: Database):
        self.identity = identity
        self.lease_s = lease_s
        self.db = db
        self.epoch = 0  # 0: not registered yet
        self.started_at = repo.utcnow()
        self._lock = threading.Lock()

    @property
    def renew_every_s(self) -> float:
        """Three renewals fit in one lease: one late heartbeat does not lose it."""
        return self.lease_s / 3

    def register(self) -> int:
        """Take a new lease; what the writer held under an earlier one is settled as at a restart."""
        with self._lock:
            return self._register()

    def _register(self) -> int:
        self.epoch = self.db.run(
            lambda s: repo.register_writer(
                s, self.identity, lease_s=self.lease_s, started_at=self.started_at, staged_exists=staged_exists
            )
        )
        return self.epoch

    def lost(self, epoch: int, why: object) -> None:
        """Work under lease `epoch` was refused: register again, once, whichever thread noticed first."""
        with self._lock:
            if epoch != self.epoch:
                return  # another thread has registered again already
            log.warning(
                "writer %s: lease %d lost (%s); its unrecorded work is dropped, registering again",
                self.identity,
                epoch,
                why,
            )
            self._register()
            log.info("writer %s: registered again with lease %d", self.identity, self.epoch)

    def take_over_expired(self) -> None:
        """Give back the samples of writers whose lease ran out (any writer may do it)."""
        for identity, requeued in self.db.run(repo.expire_leases):
            log.warning("writer %s lost its lease: %d of its samples went back to the queue", identity, requeued)

"""The writer's transactions outlast database outages: each is retried until it lands, while the
writer's status says that it waits for the database. Inside `fenced(epoch)`, each transaction
first checks that the writer's lease is still the one the work started under (repository.check_lease)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from hsx.db import repository as repo
from hsx.extraction.backoff import Backoff
from hsx.extraction.server_watch import ServerWatch
from hsx.extraction.status import WriterStatus

T = TypeVar("T")


class Database:
    def __init__(
        self,
        sessions: sessionmaker[Session],
        status: WriterStatus,
        server: ServerWatch,
        stop: threading.Event,
        identity: str,
    ):
        self.sessions = sessions
        self.status = status
        self.server = server
        self.stop = stop
        self.identity = identity
        self._local = threading.local()

    @contextmanager
    def fenced(self, epoch: int) -> Iterator[None]:
        """This thread's transactions record work done under lease `epoch`: each one fails with
        LeaseLost once that lease has expired or been taken over."""
        self._local.epoch = epoch
        try:
            yield
        finally:
            self._local.epoch = None

    def run(self, fn: Callable[[Session], T]) -> T:
        """Run fn in a transaction, retrying while the database is unreachable or locked (until the
        writer stops)."""
        backoff = Backoff()
        epoch = getattr(self._local, "epoch", None)
        while True:
            try:
                with self.sessions.begin() as s:
                    if epoch is not None:
                        repo.check_lease(s, self.identity, epoch)
                    result = fn(s)
                if self.status.state == "waiting" and (self.status.reason or "").startswith("database"):
                    self.status.set("ready" if self.server.usable else "starting")
                return result
            except (OperationalError, InterfaceError) as exc:
                if self.stop.is_set():
                    raise
                self.status.set("waiting", f"database unavailable: {type(exc.orig).__name__}: {exc.orig}")
                self.stop.wait(backoff.next())

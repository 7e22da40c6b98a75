"""The writer's transactions outlast database outages: each is retried until it lands, while the
writer's status says that it waits for the database."""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

from hsx.extraction.backoff import Backoff
from hsx.extraction.server_watch import ServerWatch
from hsx.extraction.status import WriterStatus
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

T = TypeVar("T")


class Database:
    def __init__(
        self, sessions: sessionmaker[Session], status: WriterStatus, server: ServerWatch, stop: threading.Event
    ):
        self.sessions = sessions
        self.status = status
        self.server = server
        self.stop = stop

    def run(self, fn: Callable[[Session], T]) -> T:
        """Run fn in a transaction, retrying while the database is unreachable or locked (until the
        writer stops)."""
        backoff = Backoff()
        while True:
            try:
                with self.sessions.begin() as s:
                    result = fn(s)
                if self.status.state == "waiting" and (self.status.reason or "").startswith("database"):
                    self.status.set("ready" if self.server.usable else "starting")
                return result
            except (OperationalError, InterfaceError) as exc:
                if self.stop.is_set():
                    raise
                self.status.set("waiting", f"database unavailable: {type(exc.orig).__name__}: {exc.orig}")
                self.stop.wait(backoff.next())

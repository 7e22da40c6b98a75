"""What routes depend on, taken from the application's state (the one place that reads it)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, TypeVar

import anyio.to_thread
from fastapi import Depends, Request
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from hsx.api.admission import Admission
from hsx.config import Settings
from hsx.extraction import Writer
from hsx.service.backend_info import BackendInfo
from hsx.service.cancelling import CancelSweeper
from hsx.service.feed import FeedWatch

log = logging.getLogger("hsx.api")

T = TypeVar("T")

# The getters below only read the app's state: on the event loop, not a worker thread each.


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_sessions(request: Request) -> sessionmaker[Session]:
    return request.app.state.sessions


async def get_read_sessions(request: Request) -> sessionmaker[Session]:
    return request.app.state.read_sessions


async def get_admission(request: Request) -> Admission:
    return request.app.state.admission


async def admitted(admission: Annotated[Admission, Depends(get_admission)]) -> AsyncIterator[None]:
    """A slot for the request's database work (hsx.api.admission), waited for on the event loop and held
    until the route's function has returned."""
    async with admission.slot():
        yield


# scope="function": a session and its slot are given back as soon as the route's function has returned (its
# answer built), before the answer is sent, however slowly the client reads it.
Admitted = Annotated[None, Depends(admitted, scope="function")]


def get_session(sessions: Annotated[sessionmaker[Session], Depends(get_sessions)], _: Admitted) -> Iterator[Session]:
    yield from _request_session(sessions)


def get_read_session(
    sessions: Annotated[sessionmaker[Session], Depends(get_read_sessions)], _: Admitted
) -> Iterator[Session]:
    yield from _request_session(sessions)


def _request_session(sessions: sessionmaker[Session]) -> Iterator[Session]:
    session = sessions()
    try:
        yield session
    finally:
        end_session(session)


def end_session(session: Session) -> None:
    """Close a session whose work is done. A connection the database dropped meanwhile fails the
    rollback that ends it: the answer stands (what it wrote was committed before it), so the connection
    is discarded, with a line in the log, instead of the error reaching the server, which would cut the
    client's keep-alive connection mid-answer."""
    try:
        session.close()
    except DBAPIError as exc:
        log.warning("database connection lost as a request ended (%s); discarded", type(exc.orig).__name__)
        session.invalidate()


@dataclass(frozen=True)
class Probe:
    """/healthz's and /metrics' own way to the database: an engine of a few connections and as many
    threads, apart from the requests' (hsx.api.admission), so that a liveness probe or a scrape is
    answered at once however many requests wait."""

    sessions: sessionmaker[Session]
    threads: anyio.CapacityLimiter

    async def run(self, work: Callable[[Session], T]) -> T:
        """`work` with a session of the probe's engine, on one of its threads."""

        def call() -> T:
            session = self.sessions()
            try:
                return work(session)
            finally:
                end_session(session)

        return await anyio.to_thread.run_sync(call, limiter=self.threads)


async def get_probe(request: Request) -> Probe:
    return request.app.state.probe


async def get_backend(request: Request) -> BackendInfo:
    return request.app.state.backend


async def get_writer(request: Request) -> Writer | None:
    """This process's writer; None when another process runs it."""
    return request.app.state.writer


async def get_cancels(request: Request) -> CancelSweeper:
    """This process's sweeper, which completes cancels in the background."""
    return request.app.state.cancels


async def get_feed(request: Request) -> FeedWatch:
    """This process's watch over the jobs that followers wait on (long polls of the commit feed)."""
    return request.app.state.feed


SettingsDep = Annotated[Settings, Depends(get_settings)]
# A session per request, with its slot; the factories, for work that outlives one (streams, threads), which
# takes a slot (AdmissionDep) for each use.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]
ReadSessionDep = Annotated[Session, Depends(get_read_session, scope="function")]
SessionsDep = Annotated[sessionmaker[Session], Depends(get_sessions)]
ReadSessionsDep = Annotated[sessionmaker[Session], Depends(get_read_sessions)]
AdmissionDep = Annotated[Admission, Depends(get_admission)]
ProbeDep = Annotated[Probe, Depends(get_probe)]
BackendDep = Annotated[BackendInfo, Depends(get_backend)]
WriterDep = Annotated[Writer | None, Depends(get_writer)]
CancelsDep = Annotated[CancelSweeper, Depends(get_cancels)]
FeedDep = Annotated[FeedWatch, Depends(get_feed)]

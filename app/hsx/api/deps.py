"""What routes depend on, taken from the application's state (the one place that reads it)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session, sessionmaker

from hsx.config import Settings
from hsx.extraction import Writer
from hsx.service.backend_info import BackendInfo
from hsx.service.cancelling import CancelSweeper

log = logging.getLogger("hsx.api")


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_sessions(request: Request) -> sessionmaker[Session]:
    return request.app.state.sessions


def get_read_sessions(request: Request) -> sessionmaker[Session]:
    return request.app.state.read_sessions


def get_session(sessions: Annotated[sessionmaker[Session], Depends(get_sessions)]) -> Iterator[Session]:
    yield from _request_session(sessions)


def get_read_session(sessions: Annotated[sessionmaker[Session], Depends(get_read_sessions)]) -> Iterator[Session]:
    yield from _request_session(sessions)


def _request_session(sessions: sessionmaker[Session]) -> Iterator[Session]:
    session = sessions()
    try:
        yield session
    finally:
        _end(session)


def _end(session: Session) -> None:
    """Close a request's session, which FastAPI does after the answer has started. A connection the
    database dropped meanwhile fails the rollback that ends it: the answer stands (what it wrote was
    committed before it), so the connection is discarded, with a line in the log, instead of the
    error reaching the server, which would cut the client's keep-alive connection mid-answer."""
    try:
        session.close()
    except DBAPIError as exc:
        log.warning("database connection lost as a request ended (%s); discarded", type(exc.orig).__name__)
        session.invalidate()


def get_backend(request: Request) -> BackendInfo:
    return request.app.state.backend


def get_writer(request: Request) -> Writer | None:
    """This process's writer; None when another process runs it."""
    return request.app.state.writer


def get_cancels(request: Request) -> CancelSweeper:
    """This process's sweeper, which completes cancels in the background."""
    return request.app.state.cancels


SettingsDep = Annotated[Settings, Depends(get_settings)]
# A session per request; the factories, for work that outlives one (streams, threads).
SessionDep = Annotated[Session, Depends(get_session)]
ReadSessionDep = Annotated[Session, Depends(get_read_session)]
SessionsDep = Annotated[sessionmaker[Session], Depends(get_sessions)]
ReadSessionsDep = Annotated[sessionmaker[Session], Depends(get_read_sessions)]
BackendDep = Annotated[BackendInfo, Depends(get_backend)]
WriterDep = Annotated[Writer | None, Depends(get_writer)]
CancelsDep = Annotated[CancelSweeper, Depends(get_cancels)]

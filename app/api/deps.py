"""Dependencies shared by the routers: the request's database session and the settings."""

from __future__ import annotations

from typing import Annotated, Iterator

from fastapi import Depends, Request
from hsx.config import Settings
from sqlalchemy.orm import Session


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.sessions() as session:
        yield session


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_read_session(request: Request) -> Iterator[Session]:
    with request.app.state.read_sessions() as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]
ReadSessionDep = Annotated[Session, Depends(get_read_session)]
SettingsDep = Annotated[Settings, Depends(get_settings)]

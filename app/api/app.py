"""The FastAPI application: migrations at start, the dump-root writer in the background."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI
from sqlalchemy import text

from app.api import jobs, problems
from app.api.deps import ReadSessionDep
from app.api.schemas import Health
from app.config import Settings
from app.db.engine import make_engine, session_factory, upgrade
from app.scheduler.writer import Writer

log = logging.getLogger("hsx.api")


def create_app(settings: Settings, writer: Writer | None = None) -> FastAPI:
    """Build the app. `writer`, when given, is already acquired and is started with the app."""
    engine = make_engine(settings.database_url)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        upgrade(engine)
        if writer is not None:
            writer.start_thread()
        yield
        if writer is not None:
            writer.stop()
        engine.dispose()

    app = FastAPI(
        title="hsx",
        version="0.1.0",
        summary="Extract hidden states sample by sample from an SGLang-style server into validated shards.",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.sessions = session_factory(engine)
    app.state.read_sessions = session_factory(engine, readonly=True)
    app.state.writer = writer
    problems.install(app)
    app.include_router(jobs.router)

    @app.get("/healthz", response_model=Health, tags=["health"], summary="Liveness, database and writer status")
    def healthz(session: ReadSessionDep) -> Health:
        try:
            session.execute(text("SELECT 1"))
            db = "ok"
        except Exception as exc:  # report, don't raise: health must answer while the database is down
            db = f"error: {type(exc).__name__}"
        w = app.state.writer
        status = None
        if w is not None:
            status = {"identity": w.identity, "state": w.status.state, "reason": w.status.reason,
                      "server": w.status.server}
        ok = db == "ok" and (status is None or status["state"] == "ready")
        return Health(status="ok" if ok else "degraded", database=db, writer=status)

    return app

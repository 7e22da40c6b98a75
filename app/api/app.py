"""The FastAPI application: migrations at start, the dump-root writer in the background."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import PlainTextResponse
from hsx.api import jobs, problems, security
from hsx.api.backend_info import BackendInfo
from hsx.api.deps import ReadSessionDep
from hsx.api.schemas import Health, JobCreate
from hsx.config import Settings
from hsx.db import repository as repo
from hsx.db.engine import make_engine, session_factory, upgrade
from hsx.db.models import JobRow
from hsx.extraction import Writer
from hsx.states import SampleState
from sqlalchemy import func, select, text

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
    app.state.backend = BackendInfo(settings.backend_url)
    problems.install(app)
    security.install(app, settings.api_tokens)
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
            status = {
                "identity": w.identity,
                "state": w.status.state,
                "reason": w.status.reason,
                "server": w.status.server,
            }
        writers = []
        if db == "ok":
            writers = [
                {
                    "identity": w.identity,
                    "state": w.state,
                    "reason": w.reason,
                    "server": w.server,
                    "heartbeat_at": w.heartbeat_at.isoformat(),
                }
                for w in repo.live_writers(session)
            ]
        ok = db == "ok" and (status is None or status["state"] == "ready")
        return Health(status="ok" if ok else "degraded", database=db, writer=status, writers=writers)

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        tags=["health"],
        summary="Prometheus metrics: samples by state, tokens per second, backend latency, retries by reason",
    )
    def metrics(session: ReadSessionDep) -> PlainTextResponse:
        lines = ["# HELP hsx_jobs Jobs by state.", "# TYPE hsx_jobs gauge"]
        for state, n in session.execute(select(JobRow.state, func.count()).group_by(JobRow.state)).all():
            lines.append(f'hsx_jobs{{state="{state}"}} {n}')
        sums = session.execute(
            select(*[func.coalesce(func.sum(getattr(JobRow, f"n_{s}")), 0) for s in SampleState])
        ).one()
        lines += ["# HELP hsx_samples Samples by state, over all jobs.", "# TYPE hsx_samples gauge"]
        lines += [f'hsx_samples{{state="{s}"}} {n}' for s, n in zip(SampleState, sums)]
        if app.state.writer is not None:
            w = app.state.writer
            lines += [
                "# HELP hsx_writer_ready Whether the dump-root writer can extract now.",
                "# TYPE hsx_writer_ready gauge",
                f"hsx_writer_ready {int(w.status.state == 'ready')}",
            ]
            lines += w.metrics.render()
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    def openapi():
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            components["Problem"] = problems.PROBLEM_SCHEMA
            components.setdefault("JobCreate", JobCreate.model_json_schema(ref_template="#/components/schemas/{model}"))
            for name, sub in components["JobCreate"].pop("$defs", {}).items():
                components.setdefault(name, sub)
            if settings.api_tokens:
                components_root = schema["components"]
                components_root["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
                schema["security"] = [{"bearer": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app

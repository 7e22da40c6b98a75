"""The FastAPI application, with the dump-root writer and the completion of cancels in the background,
and the dashboard."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI

from hsx.api import consumers, dashboard, docs_page, jobs, openapi, problems, query, routing, security, system
from hsx.api.admission import Admission
from hsx.api.bodies import LargeBodies, map_large_blocks
from hsx.api.deps import Probe
from hsx.api.responses import NewlineJSONResponse
from hsx.config import Settings, parse_tokens
from hsx.db.engine import CONNECTIONS, make_engine, session_factory
from hsx.extraction import Writer
from hsx.service.backend_info import BackendInfo
from hsx.service.cancelling import CancelSweeper
from hsx.service.feed import FeedWatch

# Of the API engine's connections, those its background work may hold: the cancel sweeper's, and one to
# spare. Requests share the rest, a slot each (hsx.api.admission).
BACKGROUND_CONNECTIONS = 2
# /healthz and /metrics: an engine and threads of their own, one each when both are asked at once.
PROBE_CONNECTIONS = 2


def create_app(settings: Settings, writer: Writer | None = None) -> FastAPI:
    """Build the app on a database migrated to the newest schema (`hsx serve` migrates it first).
    `writer`, when given, is already acquired and is started with the app."""
    map_large_blocks()
    engine = make_engine(settings.database_url)
    probe_engine = make_engine(settings.database_url, connections=PROBE_CONNECTIONS)
    sessions = session_factory(engine)
    cancels = CancelSweeper(sessions, settings.output_root, settings.cancel_batch)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        cancels.start()
        if writer is not None:
            writer.start_thread()
        yield
        if writer is not None:
            writer.stop()
        cancels.stop()
        engine.dispose()
        probe_engine.dispose()

    app = FastAPI(
        title="hsx",
        version="0.1.0",
        summary="Extract hidden states sample by sample from SGLang or vLLM into validated shards.",
        lifespan=lifespan,
        redirect_slashes=False,  # hsx.api.routing redirects, with a relative Location
        generate_unique_id_function=openapi.operation_id,
        docs_url=None,  # hsx.api.docs_page: a pinned Swagger UI under a content security policy
        redoc_url=None,
        default_response_class=NewlineJSONResponse,
    )
    # What the routes depend on (hsx.api.deps reads it).
    app.state.settings = settings
    app.state.sessions = sessions
    app.state.read_sessions = session_factory(engine, readonly=True)
    app.state.admission = Admission(CONNECTIONS - BACKGROUND_CONNECTIONS, settings.connection_wait_s)
    app.state.feed = FeedWatch(app.state.read_sessions, app.state.admission.check)
    app.state.probe = Probe(session_factory(probe_engine, readonly=True), anyio.CapacityLimiter(PROBE_CONNECTIONS))
    app.state.writer = writer
    app.state.cancels = cancels
    app.state.backend = BackendInfo(settings)
    app.state.large_bodies = LargeBodies(settings.max_large_bodies, settings.large_body_bytes)
    problems.install(app)
    query.install(app)
    security.install(app, settings.api_tokens)
    routers = [jobs.router, consumers.router, system.router]
    for router in routers:
        app.include_router(router)
    dashboard.install(app)
    docs_page.install(app)
    routing.install(app, routers)
    openapi.install(app, bearer=bool(parse_tokens(settings.api_tokens)))
    return app

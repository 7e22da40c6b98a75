"""/healthz, /metrics and /v1/token: whether the service can work, what it has done, and what the
caller's token may do."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from sqlalchemy import func, select, text

from hsx.api.deps import ReadSessionDep, SettingsDep, WriterDep
from hsx.api.problems import PROBLEM_MEDIA_TYPE
from hsx.config import parse_tokens
from hsx.db import repository as repo
from hsx.db.models import JobRow, WriterRow
from hsx.states import SampleState
from hsx.wire import Health, TokenInfo, WorkerList, WorkerOut, WriterOut, utc

router = APIRouter(tags=["health"])


@router.api_route(
    "/healthz", methods=["GET", "HEAD"], response_model=Health, summary="Liveness, database and writer status"
)
def healthz(request: Request, session: ReadSessionDep, writer: WriterDep, settings: SettingsDep) -> Health:
    try:
        session.execute(text("SELECT 1"))
        db = "ok"
    except Exception as exc:  # report, don't raise: health must answer while the database is down
        db = f"error: {type(exc).__name__}"
    # With --api-tokens, a caller without a token learns whether the service can work, not where it
    # runs: no host, dump root, model server, model or boot id.
    detailed = not settings.api_tokens or getattr(request.state, "role", None) is not None
    status: dict[str, Any] | None = None
    if writer is not None:
        status = {"state": writer.status.state}
        if detailed:
            status |= {
                "identity": writer.identity,
                "reason": writer.status.reason,
                "server": writer.status.server,
                "tokens_per_s": round(writer.metrics.tokens_per_second(), 3),
            }
    writers = []
    if db == "ok" and detailed:
        writers = [
            WriterOut(
                identity=w.identity,
                state=w.state,
                reason=w.reason,
                server=w.server,
                heartbeat_at=utc(w.heartbeat_at),
                tokens_per_s=(w.stats or {}).get("tokens_per_s"),
            )
            for w in repo.live_writers(session)
        ]
    ok = db == "ok" and (status is None or status["state"] == "ready")
    return Health(status="ok" if ok else "degraded", database=db, writer=status, writers=writers)


@router.api_route(
    "/v1/workers",
    methods=["GET", "HEAD"],
    response_model=WorkerList,
    tags=["workers"],
    summary="Every writer that ever registered: its model server, layers, state, lease and rate",
)
def workers(session: ReadSessionDep) -> WorkerList:
    return WorkerList(data=[_worker(w) for w in repo.all_writers(session)])


def _worker(w: WriterRow) -> WorkerOut:
    server, stats = w.server or {}, w.stats or {}
    return WorkerOut(
        identity=w.identity,
        state=w.state,
        reason=w.reason,
        backend_url=server.get("url"),
        model_path=server.get("model_path"),
        model_key=server.get("model_key"),
        layers=server.get("layers"),
        source=server.get("source"),
        started_at=utc(w.started_at),
        heartbeat_at=utc(w.heartbeat_at),
        lease_expires_at=utc(w.lease_expires_at),
        lease=w.epoch,
        samples_staged=stats.get("samples_staged"),
        tokens_per_s=stats.get("tokens_per_s"),
    )


@router.api_route(
    "/metrics",
    methods=["GET", "HEAD"],
    response_class=PlainTextResponse,
    summary="Prometheus metrics: samples by state, tokens per second, backend latency, retries by reason",
)
def metrics(session: ReadSessionDep, writer: WriterDep) -> PlainTextResponse:
    lines = ["# HELP hsx_jobs Jobs by state.", "# TYPE hsx_jobs gauge"]
    for state, n in session.execute(select(JobRow.state, func.count()).group_by(JobRow.state)).all():
        lines.append(f'hsx_jobs{{state="{state}"}} {n}')
    sums = session.execute(select(*[func.coalesce(func.sum(getattr(JobRow, f"n_{s}")), 0) for s in SampleState])).one()
    lines += ["# HELP hsx_samples Samples by state, over all jobs.", "# TYPE hsx_samples gauge"]
    lines += [f'hsx_samples{{state="{s}"}} {n}' for s, n in zip(SampleState, sums)]
    if writer is not None:
        lines += [
            "# HELP hsx_writer_ready Whether the dump-root writer can extract now.",
            "# TYPE hsx_writer_ready gauge",
            f"hsx_writer_ready {int(writer.status.state == 'ready')}",
        ]
        lines += writer.metrics.render()
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


@router.api_route(
    "/v1/token",
    methods=["GET", "HEAD"],
    response_model=TokenInfo,
    tags=["access"],
    responses={
        401: {
            "description": "Missing or unknown token (only when the service has tokens)",
            "content": {PROBLEM_MEDIA_TYPE: {"schema": {"$ref": "#/components/schemas/Problem"}}},
        }
    },
    summary="What the presented bearer token may do",
    description="A client (the dashboard) asks before it offers actions: a read token gets none that would "
    "fail. Without --api-tokens every caller may write.",
)
def token_info(request: Request, settings: SettingsDep) -> TokenInfo:
    required = bool(parse_tokens(settings.api_tokens))
    return TokenInfo(tokens_required=required, role=getattr(request.state, "role", "write"))

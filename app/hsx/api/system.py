"""/healthz, /metrics and /v1/token: whether the service can work, what it has done, and what the
caller's token may do."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from sqlalchemy.orm import Session

from hsx.api.deps import ProbeDep, ReadSessionDep, SettingsDep, WriterDep
from hsx.api.problems import PROBLEM_MEDIA_TYPE
from hsx.config import parse_tokens
from hsx.extraction import Writer
from hsx.extraction.exposition import METRICS_MEDIA_TYPE, preparer_health, writer_lines
from hsx.service import status as service
from hsx.wire import Health, TokenInfo, WorkerList, WriterOut

router = APIRouter(tags=["health"])


@router.api_route(
    "/healthz",
    methods=["GET", "HEAD"],
    response_model=Health,
    summary="Liveness, database and writer status",
    description="`status` is ok while the database answers, this process's writer (if any) is ready and no "
    "preparer is failing; `writers` lists each writer with the layer sets its server gives (`layer_sets`) and "
    "whether it takes a job of the default set (`serves_default`); `warnings` says what keeps jobs waiting "
    "although the status is ok, such as no ready writer giving the default layer set.",
)
async def healthz(request: Request, probe: ProbeDep, writer: WriterDep, settings: SettingsDep) -> Health:
    # With --api-tokens, a caller without a token learns whether the service can work, not where it
    # runs: no host, dump root, model server, model or boot id.
    detailed = not settings.api_tokens or getattr(request.state, "role", None) is not None
    return await probe.run(lambda session: _health(session, writer, detailed))


def _health(session: Session, writer: Writer | None, detailed: bool) -> Health:
    db = service.database_status(session=session)
    status: dict[str, Any] | None = None
    own = _own(writer)
    if writer is not None:
        status = {"state": writer.status.state}
        if detailed and own is not None:
            status |= {
                "identity": writer.identity,
                "reason": writer.status.reason,
                "server": writer.status.server,
                "tokens_per_s": own.tokens_per_s,
                "preparer": preparer_health(writer.preparer),
            }
    writers: list[WriterOut] = []
    warnings: list[str] = []
    if db == "ok":
        writers, warnings = service.live_writers(session=session, own=own)
    preparing = writer is None or writer.preparer.state != "failing"
    preparing = preparing and not any(w.preparer is not None and w.preparer.state == "failing" for w in writers)
    ok = db == "ok" and (status is None or status["state"] == "ready") and preparing
    # Warnings name no host or dump root: a caller without a token may read them.
    return Health(
        status="ok" if ok else "degraded",
        database=db,
        writer=status,
        writers=writers if detailed else [],
        warnings=warnings,
    )


def _own(writer: Writer | None) -> service.OwnWriter | None:
    """This process's writer with its rate read once: /healthz and /metrics show that one figure for it,
    wherever they show it."""
    if writer is None:
        return None
    return service.OwnWriter(writer.identity, writer.metrics.tokens_per_second())


@router.api_route(
    "/v1/workers",
    methods=["GET", "HEAD"],
    response_model=WorkerList,
    tags=["workers"],
    summary="Every writer that ever registered: its model server, layers, state, lease and rate",
)
def workers(session: ReadSessionDep) -> WorkerList:
    return service.worker_list(session=session)


@router.api_route(
    "/metrics",
    methods=["GET", "HEAD"],
    response_class=PlainTextResponse,
    summary="Prometheus metrics: jobs, samples and writers by state, attempts by reason, this process's writer",
    description="From the database (counters and small tables only, whatever the jobs' size): jobs and samples "
    "by state, samples waiting for another attempt, the active jobs' attempts by outcome and reason code, "
    "writers by state with each one's tokens per second and heartbeat age. With a writer in this process "
    "(`hsx serve` without --no-writer), its own lines too, as `hsx worker --metrics-port` serves them: its "
    "readiness and state, attempts by outcome and reason, backend request and shard write latency "
    "histograms, tokens, samples and bytes staged, shards written, tokens per second. With --api-tokens it "
    "needs a token like any other endpoint (a read token is enough).",
)
async def metrics(probe: ProbeDep, writer: WriterDep) -> PlainTextResponse:
    lines = await probe.run(lambda session: _metric_lines(session, writer))
    return PlainTextResponse("\n".join(lines) + "\n", media_type=METRICS_MEDIA_TYPE)


def _metric_lines(session: Session, writer: Writer | None) -> list[str]:
    own = _own(writer)
    lines = service.state_metrics(session=session, own=own)
    if writer is not None and own is not None:
        lines += writer_lines(writer, own.tokens_per_s)
    return lines


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
async def token_info(request: Request, settings: SettingsDep) -> TokenInfo:
    required = bool(parse_tokens(settings.api_tokens))
    return TokenInfo(tokens_required=required, role=getattr(request.state, "role", "write"))

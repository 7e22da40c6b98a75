"""/healthz and /metrics: whether the service can work, and what it has done."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from hsx.api.deps import ReadSessionDep, WriterDep
from hsx.api.schemas import Health
from hsx.db import repository as repo
from hsx.db.models import JobRow
from hsx.states import SampleState
from sqlalchemy import func, select, text

router = APIRouter(tags=["health"])


@router.api_route(
    "/healthz", methods=["GET", "HEAD"], response_model=Health, summary="Liveness, database and writer status"
)
def healthz(session: ReadSessionDep, writer: WriterDep) -> Health:
    try:
        session.execute(text("SELECT 1"))
        db = "ok"
    except Exception as exc:  # report, don't raise: health must answer while the database is down
        db = f"error: {type(exc).__name__}"
    status = None
    if writer is not None:
        status = {
            "identity": writer.identity,
            "state": writer.status.state,
            "reason": writer.status.reason,
            "server": writer.status.server,
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

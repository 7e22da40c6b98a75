"""What the service's health and metrics read from the database: whether it answers, the writers that
reported, and how many jobs and samples are in each state."""

from __future__ import annotations

from sqlalchemy.orm import Session

from hsx.db import repository as repo
from hsx.service.views import worker_out, writer_out
from hsx.states import SampleState
from hsx.wire import WorkerList, WriterOut


def database_status(*, session: Session) -> str:
    """ "ok", or the kind of error the database answered with."""
    try:
        repo.ping(session)
    except Exception as exc:  # report, don't raise: health must answer while the database is down
        return f"error: {type(exc).__name__}"
    return "ok"


def live_writers(*, session: Session) -> list[WriterOut]:
    """Every writer that reported recently."""
    return [writer_out(w) for w in repo.live_writers(session)]


def worker_list(*, session: Session) -> WorkerList:
    """Every writer that ever registered."""
    return WorkerList(data=[worker_out(w) for w in repo.all_writers(session)])


def state_metrics(*, session: Session) -> list[str]:
    """Prometheus lines: jobs by state, and samples by state over all jobs."""
    lines = ["# HELP hsx_jobs Jobs by state.", "# TYPE hsx_jobs gauge"]
    lines += [f'hsx_jobs{{state="{state}"}} {n}' for state, n in repo.jobs_by_state(session)]
    lines += ["# HELP hsx_samples Samples by state, over all jobs.", "# TYPE hsx_samples gauge"]
    samples = repo.samples_by_state(session)
    lines += [f'hsx_samples{{state="{s}"}} {samples[s]}' for s in SampleState]
    return lines

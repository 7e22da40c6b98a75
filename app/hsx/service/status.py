"""What the service's health and metrics read from the database: whether it answers, the writers that
reported, and how many jobs, samples, attempts and writers are in each state.

Every figure here comes from counters and small tables (the jobs' per-state counters, the active jobs'
attempt counts, the writers table), never from counting samples or attempts, so that a scrape costs the
same whatever the jobs' size."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

from sqlalchemy.orm import Session

from hsx.db import repository as repo
from hsx.extraction.metrics import label
from hsx.matching import default_layers_warning
from hsx.service.feed import consumer_metrics
from hsx.service.views import worker_out, writer_out
from hsx.states import SampleState
from hsx.wire import WorkerList, WriterOut, utc

# A writer stopped on purpose, or whose lease others took over, is no longer expected to report.
GONE_STATES = ("stopped", "lost")


@dataclass(frozen=True)
class OwnWriter:
    """This process's writer as it is now: its row in the database shows it as of its last heartbeat."""

    identity: str
    tokens_per_s: float


def database_status(*, session: Session) -> str:
    """ "ok", or the kind of error the database answered with."""
    try:
        repo.ping(session)
    except Exception as exc:  # report, don't raise: health must answer while the database is down
        return f"error: {type(exc).__name__}"
    return "ok"


def live_writers(*, session: Session, own: OwnWriter | None = None) -> tuple[list[WriterOut], list[str]]:
    """Every writer that reported recently, and what about them keeps jobs waiting (/healthz's `warnings`: no
    ready writer gives the default layer set); this process's own writer (`own`) with its rate as of now, the
    figure /healthz's `writer` shows, not as of its last heartbeat."""
    rows = repo.live_writers(session)
    writers = [writer_out(w) for w in rows]
    if own is not None:
        now = {"tokens_per_s": own.tokens_per_s}
        writers = [w.model_copy(update=now) if w.identity == own.identity else w for w in writers]
    return writers, [warning for warning in [default_layers_warning(rows)] if warning]


def worker_list(*, session: Session) -> WorkerList:
    """Every writer that ever registered."""
    return WorkerList(data=[worker_out(w) for w in repo.all_writers(session)])


def state_metrics(*, session: Session, own: OwnWriter | None = None) -> list[str]:
    """Prometheus lines: jobs by state, samples by state and those waiting for another attempt over all
    jobs, the active jobs' attempts by outcome and reason, and the registered writers."""
    lines = ["# HELP hsx_jobs Jobs by state.", "# TYPE hsx_jobs gauge"]
    lines += [f'hsx_jobs{{state="{state}"}} {n}' for state, n in repo.jobs_by_state(session)]
    lines += ["# HELP hsx_samples Samples by state, over all jobs.", "# TYPE hsx_samples gauge"]
    samples = repo.samples_by_state(session)
    lines += [f'hsx_samples{{state="{s}"}} {samples[s]}' for s in SampleState]
    lines += [
        "# HELP hsx_samples_waiting_retry Queued samples tried before, waiting for another attempt, over all jobs.",
        "# TYPE hsx_samples_waiting_retry gauge",
        f"hsx_samples_waiting_retry {repo.requeued_samples(session)}",
        "# HELP hsx_job_attempts Attempts of the active jobs (queued, running, cancelling) by outcome and reason "
        "code, as the jobs count them (every writer's together).",
        "# TYPE hsx_job_attempts gauge",
    ]
    lines += [
        f'hsx_job_attempts{{outcome="{label(o)}",reason="{label(r)}"}} {n}'
        for o, r, n in repo.active_attempt_counts(session)
    ]
    return lines + worker_metrics(session, own) + consumer_metrics(session)


def worker_metrics(session: Session, own: OwnWriter | None) -> list[str]:
    """Prometheus lines from the writers table: writers by state, and for each writer not gone its rate
    (as of its last heartbeat; this process's own as of now) and how long ago it reported."""
    writers = repo.all_writers(session)
    now = time.time()
    lines = ["# HELP hsx_workers Registered writers by their last reported state.", "# TYPE hsx_workers gauge"]
    lines += [f'hsx_workers{{state="{label(s)}"}} {n}' for s, n in sorted(Counter(w.state for w in writers).items())]
    present = [w for w in writers if w.state not in GONE_STATES]
    lines += [
        "# HELP hsx_worker_tokens_per_second Tokens a writer extracted per second over the last minute, as of "
        "its last heartbeat (this process's writer: now).",
        "# TYPE hsx_worker_tokens_per_second gauge",
    ]
    for w in present:
        rate = own.tokens_per_s if own and own.identity == w.identity else (w.stats or {}).get("tokens_per_s")
        lines.append(f'hsx_worker_tokens_per_second{{identity="{label(w.identity)}"}} {float(rate or 0):.3f}')
    lines += [
        "# HELP hsx_worker_heartbeat_age_seconds Seconds since a writer last reported (its lease is renewed "
        "every third of --lease-s).",
        "# TYPE hsx_worker_heartbeat_age_seconds gauge",
    ]
    lines += [
        f'hsx_worker_heartbeat_age_seconds{{identity="{label(w.identity)}"}} '
        f"{max(0.0, now - utc(w.heartbeat_at).timestamp()):.1f}"
        for w in present
    ]
    return lines

"""What the jobs API reads: pages of jobs and samples, one job or sample, a job's shards and throughput,
each answered as the wire model the route returns."""

from __future__ import annotations

from sqlalchemy.orm import Session

from hsx.db import repository as repo
from hsx.db.models import JobRow
from hsx.names import shown
from hsx.service.errors import InvalidInput
from hsx.service.feed import held_reasons
from hsx.service.jobs import get_job, get_sample
from hsx.service.views import job_out, sample_out, throughput_out
from hsx.wire import JobOut, JobPage, SampleOut, SamplePage, Throughput


def job_page(*, session: Session, state: str | None, after: str | None, limit: int) -> JobPage:
    """Jobs newest first, `limit` of them after the job `after` (an empty `after` is the first page), each
    with why it waits. As a samples page's, an `after` that is no cursor this route hands out is
    InvalidInput: here anything but a job id. A job id is a place in the order (ids sort by creation),
    so the id of a job deleted since still continues where its page ended."""
    if after and not repo.is_job_id(after):
        raise InvalidInput([{"field": "after", "message": f"{shown(after)} is not a job id to continue after"}])
    rows = repo.list_jobs(session, state=state, after=after or None, limit=limit + 1)
    page = rows[:limit]
    waiting = repo.waiting(session)
    held = held_reasons(session, page)
    attempts = repo.attempt_counts(session, [j.id for j in page])
    return JobPage(
        data=[job_out(j, _why(held.get(j.id), waiting.reason(j)), attempts.get(j.id)) for j in page],
        has_more=len(rows) > limit,
        next_after=page[-1].id if len(rows) > limit else None,
    )


def job_view(*, session: Session, job_id: str) -> JobOut:
    """The job with its progress, attempts and why it waits, or NotFound."""
    return job_answer(session=session, job=get_job(session=session, job_id=job_id))


def job_view_if_any(*, session: Session, job_id: str) -> JobOut | None:
    """As job_view, None for a job that is not (or no longer) there: a stream of its events ends quietly."""
    job = repo.get_job(session, job_id)
    return job_answer(session=session, job=job) if job else None


def job_answer(*, session: Session, job: JobRow) -> JobOut:
    """A job as read (or as an action left it): with its attempts and why it waits."""
    why = _why(held_reasons(session, [job]).get(job.id), repo.waiting(session).reason(job))
    return job_out(job, why, repo.attempt_counts(session, [job.id]).get(job.id))


def _why(held: str | None, writers: str | None) -> str | None:
    """A job's waiting reason: its consumers first (no writer claims it while they lag), then its writers."""
    return "; ".join(r for r in (held, writers) if r) or None


def job_throughput(*, session: Session, job_id: str, points: int, now: float) -> Throughput:
    """What the job extracted over time, in at most `points` windows, or NotFound."""
    job = get_job(session=session, job_id=job_id)
    width, history = repo.job_throughput(session, job, points=points, now=now)
    return throughput_out(job.id, width, history)


def sample_page(*, session: Session, job_id: str, state: str | None, after: str | None, limit: int) -> SamplePage:
    """The job's samples in input order, `limit` of them after the sample `after` (an empty `after`, which
    the document allows, is the first page); NotFound for the job, InvalidInput for an unknown `after`."""
    get_job(session=session, job_id=job_id)
    after_idx = None
    if after:
        anchor = repo.get_sample(session, job_id, after)
        if anchor is None:
            message = f"no sample {shown(after)} in this job to continue after"
            raise InvalidInput([{"field": "after", "message": message}])
        after_idx = anchor.idx
    rows = repo.list_samples(session, job_id, state=state, after_idx=after_idx, limit=limit + 1)
    page = rows[:limit]
    return SamplePage(
        data=[sample_out(s) for s in page],
        has_more=len(rows) > limit,
        next_after=page[-1].sample_id if len(rows) > limit else None,
    )


def sample_view(*, session: Session, job_id: str, sample_id: str) -> SampleOut:
    """The sample with every attempt and its outcome, or NotFound (for the job first)."""
    sample = get_sample(session=session, job_id=job_id, sample_id=sample_id)
    return sample_out(sample, repo.sample_attempts(session, sample.pk))

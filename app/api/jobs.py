"""/v1/jobs: create jobs, watch their progress, list samples, fetch manifests and shards."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import FileResponse
from sqlalchemy.orm import Session

from app.api import intake
from app.api.deps import ReadSessionDep, SessionDep, SettingsDep
from app.api.problems import PROBLEM_MEDIA_TYPE, NotFound, ProblemError
from app.api.schemas import (
    AttemptOut,
    Counts,
    JobCreate,
    JobOut,
    SampleOut,
    SamplePage,
    SampleState,
    Tokens,
    utc,
)
from app.db import repository as repo
from app.db.models import Job, Sample
from app.manifests import job_dir, manifest_document

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
PROBLEMS = {code: {"content": {PROBLEM_MEDIA_TYPE: {}}, "description": desc}
            for code, desc in ((403, "Forbidden"), (404, "Not found"), (422, "Invalid input"))}


def job_out(job: Job) -> JobOut:
    rate = eta = None
    started = utc(job.started_at)
    if started is not None:
        end = utc(job.finished_at) or datetime.now(timezone.utc)
        elapsed = (end - started).total_seconds()
        extracted = job.tokens_done + job.tokens_staged
        if elapsed > 0 and extracted:
            rate = extracted / elapsed
            eta = 0.0 if job.finished_at else (job.tokens_total - extracted) / rate
    return JobOut(
        id=job.id, name=job.name, state=job.state, error=job.error, created_at=utc(job.created_at),
        started_at=started, finished_at=utc(job.finished_at),
        counts=Counts(total=job.num_samples, queued=job.n_queued, running=job.n_running, staged=job.n_staged,
                      succeeded=job.n_succeeded, failed=job.n_failed, cancelled=job.n_cancelled),
        tokens=Tokens(total=job.tokens_total, done=job.tokens_done, staged=job.tokens_staged),
        rate_tokens_per_s=rate, eta_s=eta,
        shards_written=job.shards_written, layers=job.layers, model=job.model_info,
        manifest_url=f"/v1/jobs/{job.id}/manifest",
    )


def sample_out(s: Sample, attempts=None) -> SampleOut:
    log = None
    if attempts is not None:
        log = [AttemptOut(number=a.number, outcome=a.outcome, reason=a.reason, started_at=utc(a.started_at),
                          finished_at=utc(a.finished_at), dump=a.dump_key, observed_tokens=a.observed_tokens,
                          boot_id=a.boot_id) for a in attempts]
    return SampleOut(id=s.sample_id, index=s.idx, state=s.state, expected_tokens=s.num_tokens,
                     observed_tokens=s.observed_tokens, attempts=s.attempts, last_error=s.last_error,
                     shard=s.shard, offset=s.shard_offset, attempt_log=log)


def _job(session: Session, job_id: str) -> Job:
    job = repo.get_job(session, job_id)
    if job is None:
        raise NotFound(f"job {job_id!r}")
    return job


@router.post("", status_code=202, response_model=JobOut, responses=PROBLEMS,
             summary="Create an extraction job (inline samples or a JSONL file under the input root)")
def create_job(body: JobCreate, session: SessionDep, settings: SettingsDep) -> JobOut:
    if body.samples is not None:
        rows = intake.samples_from_body(body.samples)
    else:
        rows = intake.samples_from_jsonl(intake.resolve_input_path(settings.input_root, body.input_path))
    if body.layers is not None and (not body.layers or body.layers != sorted(set(body.layers))
                                    or body.layers[0] < 0):
        raise ProblemError(422, "layers must be non-negative, unique and ascending", field="layers")
    with session.begin():
        job = repo.create_job(session, name=body.name, layers=body.layers, samples=rows)
    return job_out(job)


@router.get("/{job_id}", response_model=JobOut, responses=PROBLEMS, summary="A job's state and progress")
def get_job(job_id: str, session: ReadSessionDep) -> JobOut:
    return job_out(_job(session, job_id))


@router.get("/{job_id}/samples", response_model=SamplePage, responses=PROBLEMS,
            summary="Per-sample state, token counts, attempts, errors and placement")
def list_samples(
    job_id: str,
    session: ReadSessionDep,
    state: SampleState | None = None,
    after: Annotated[str | None, Query(description="sample id the previous page ended with")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> SamplePage:
    _job(session, job_id)
    after_idx = None
    if after is not None:
        anchor = repo.get_sample(session, job_id, after)
        if anchor is None:
            raise ProblemError(422, f"no sample {after!r} in this job to continue after", field="after")
        after_idx = anchor.idx
    rows = repo.list_samples(session, job_id, state=state, after_idx=after_idx, limit=limit + 1)
    page = rows[:limit]
    return SamplePage(data=[sample_out(s) for s in page], has_more=len(rows) > limit,
                      next_after=page[-1].sample_id if len(rows) > limit else None)


@router.get("/{job_id}/samples/{sample_id}", response_model=SampleOut, responses=PROBLEMS,
            summary="One sample, with every attempt and its outcome")
def get_sample(job_id: str, sample_id: str, session: ReadSessionDep) -> SampleOut:
    _job(session, job_id)
    s = repo.get_sample(session, job_id, sample_id)
    if s is None:
        raise NotFound(f"sample {sample_id!r}")
    return sample_out(s, repo.sample_attempts(session, s.pk))


@router.get("/{job_id}/manifest", responses=PROBLEMS,
            summary="The job's manifest: model, layers, shards (with sha256) and where each sample lies")
def get_manifest(job_id: str, session: ReadSessionDep) -> dict:
    return manifest_document(session, _job(session, job_id))


@router.get("/{job_id}/shards/{name}", responses=PROBLEMS, response_class=FileResponse,
            summary="Download one shard (safetensors)")
def get_shard(job_id: str, name: str, session: ReadSessionDep, settings: SettingsDep):
    _job(session, job_id)
    # Only names recorded in the database are served, so no path from the URL reaches the disk.
    shard = repo.get_shard(session, job_id, name)
    if shard is None:
        raise NotFound(f"shard {name!r}")
    path = job_dir(settings.output_root, job_id) / shard.name
    return FileResponse(path, media_type="application/octet-stream", filename=shard.name,
                        headers={"X-Content-SHA256": shard.sha256})


"""/v1/jobs: create jobs, follow their progress, act on them, fetch manifests, shards and samples."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, AsyncIterator

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import FileResponse, StreamingResponse
from hsx.api import intake
from hsx.api.deps import ReadSessionDep, SessionDep, SettingsDep
from hsx.api.problems import PROBLEM_MEDIA_TYPE, InvalidInput, NotFound, ProblemError, errors_from_pydantic
from hsx.api.schemas import (
    AttemptOut,
    Counts,
    JobCreate,
    JobOut,
    JobPage,
    JobState,
    SampleOut,
    SamplePage,
    SampleState,
    Tokens,
    utc,
)
from hsx.config import Settings
from hsx.db import repository as repo
from hsx.db.models import JobRow, SampleRow
from hsx.extraction.finishing import finish_job
from hsx.layers import check_layers, parse_layers
from hsx.manifest import build_manifest, job_dir
from hsx.states import TERMINAL_JOB_STATES
from pydantic import ValidationError
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


def _problems(*codes: int) -> dict:
    text = {
        401: "Missing or unknown token",
        403: "Not allowed",
        404: "Not found",
        409: "Not allowed in this state",
        413: "Body too large",
        415: "Unsupported media type",
        416: "Range not satisfiable",
        422: "Invalid input",
        503: "Database unavailable; retry after Retry-After seconds",
        507: "Not enough room on the output volume",
    }
    schema = {"$ref": "#/components/schemas/Problem"}
    return {
        c: {"description": text[c], "content": {PROBLEM_MEDIA_TYPE: {"schema": schema}}}
        for c in (401, 403, 503, *codes)
    }


CREATE_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": {"$ref": "#/components/schemas/JobCreate"}},
            "application/x-ndjson": {
                "schema": {"type": "string", "format": "binary"},
                "description": 'one sample object per line ({"id"?, "input_ids", "loss_mask"?}); '
                "job name and layers come from the query string",
            },
        },
    }
}


def job_out(job: JobRow, waiting: str | None = None) -> JobOut:
    """The API's view of a job; `waiting` is why active jobs make no progress (see repo.waiting_reason)."""
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
        id=job.id,
        name=job.name,
        state=job.state,
        error=job.error,
        created_at=utc(job.created_at),
        waiting_reason=waiting if job.state in ("queued", "running") and (job.n_queued or job.n_running) else None,
        started_at=started,
        cancel_requested_at=utc(job.cancel_requested_at),
        finished_at=utc(job.finished_at),
        counts=Counts(
            total=job.num_samples,
            queued=job.n_queued,
            running=job.n_running,
            staged=job.n_staged,
            succeeded=job.n_succeeded,
            failed=job.n_failed,
            cancelled=job.n_cancelled,
        ),
        tokens=Tokens(total=job.tokens_total, done=job.tokens_done, staged=job.tokens_staged),
        rate_tokens_per_s=rate,
        eta_s=eta,
        shards_written=job.shards_written,
        estimated_bytes=job.estimated_bytes,
        disk_warning=job.disk_warning,
        layers=job.layers,
        model=job.model_info,
        manifest_url=f"/v1/jobs/{job.id}/manifest",
    )


def sample_out(s: SampleRow, attempts=None) -> SampleOut:
    log = None
    if attempts is not None:
        log = [
            AttemptOut(
                number=a.number,
                outcome=a.outcome,
                reason=a.reason,
                started_at=utc(a.started_at),
                finished_at=utc(a.finished_at),
                dump=a.dump_key,
                observed_tokens=a.observed_tokens,
                boot_id=a.boot_id,
            )
            for a in attempts
        ]
    return SampleOut(
        id=s.sample_id,
        index=s.idx,
        state=s.state,
        expected_tokens=s.num_tokens,
        observed_tokens=s.observed_tokens,
        attempts=s.attempts,
        last_error=s.last_error,
        shard=s.shard,
        offset=s.shard_offset,
        attempt_log=log,
    )


def _job(session: Session, job_id: str) -> JobRow:
    job = repo.get_job(session, job_id)
    if job is None:
        raise NotFound(f"job {job_id!r}")
    return job


# --- creation -------------------------------------------------------------------------------


def _replay(job: JobRow, digest: str) -> JobOut:
    """The answer to a request whose Idempotency-Key was seen before."""
    if job.request_sha256 != digest:
        raise ProblemError(
            422,
            "this Idempotency-Key was already used with a different request",
            type_="/problems/idempotency-key-reused",
            field="Idempotency-Key",
        )
    return job_out(job)


def _create_sync(
    sessions: sessionmaker, settings: Settings, limits: intake.Limits, body: JobCreate, key: str | None, digest: str
) -> JobOut:
    if key:
        with sessions() as s:
            existing = repo.job_by_idempotency_key(s, key)
            if existing is not None:
                return _replay(existing, digest)
    if body.samples is not None:
        items = intake.body_items(body.samples)
    else:
        items = intake.numbered_lines(
            intake.file_lines(intake.resolve_input_path(settings.input_root, body.input_path))
        )
    try:
        with sessions.begin() as s:
            ingest = intake.Ingest(
                s,
                limits,
                name=body.name,
                layers=body.layers,
                idempotency_key=key,
                request_sha256=digest,
                disk=_disk_check(settings),
            )
            for item in items:
                ingest.feed(*item)
            return job_out(ingest.finish())
    except IntegrityError:
        if not key:
            raise
        with sessions() as s:  # a concurrent request with the same key won the race
            return _replay(repo.job_by_idempotency_key(s, key), digest)


async def _body_chunks(request: Request, limit: int) -> AsyncIterator[bytes]:
    seen = 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > limit:
            raise ProblemError(413, f"request body exceeds {limit} bytes")
        yield chunk


async def _lines(request: Request, limit: int, digest) -> AsyncIterator[bytes]:
    rest = b""
    async for chunk in _body_chunks(request, limit):
        digest.update(chunk)
        rest += chunk
        *lines, rest = rest.split(b"\n")
        for line in lines:
            yield line
    if rest:
        yield rest


async def _create_from_ndjson(
    request: Request,
    settings: Settings,
    limits: intake.Limits,
    name: str | None,
    layers: list[int] | None,
    key: str | None,
) -> JobOut:
    sessions = request.app.state.sessions
    digest = hashlib.sha256(json.dumps(["ndjson", name, layers]).encode())
    if key:
        existing = await run_in_threadpool(_find_key, sessions, key)
        if existing is not None:
            async for _ in _lines(request, settings.max_ndjson_bytes, digest):
                pass
            return _replay(existing, digest.hexdigest())
    session = sessions()
    try:
        session.begin()
        ingest = await run_in_threadpool(
            intake.Ingest, session, limits, name=name, layers=layers, idempotency_key=key, disk=_disk_check(settings)
        )
        batch, index, lineno = [], 0, 0
        async for line in _lines(request, settings.max_ndjson_bytes, digest):
            lineno += 1
            if not line.strip():
                continue
            batch.append(intake.parse_line(index, lineno, line))
            index += 1
            if len(batch) >= intake.BATCH:
                await run_in_threadpool(_feed, ingest, batch)
                batch = []
        await run_in_threadpool(_feed, ingest, batch)
        ingest.builder.job.request_sha256 = digest.hexdigest()
        job = await run_in_threadpool(ingest.finish)
        out = job_out(job)
        await run_in_threadpool(session.commit)
        return out
    except IntegrityError:
        await run_in_threadpool(session.rollback)
        if not key:
            raise
        existing = await run_in_threadpool(_find_key, sessions, key)
        return _replay(existing, digest.hexdigest())
    except BaseException:
        await run_in_threadpool(session.rollback)
        raise
    finally:
        await run_in_threadpool(session.close)


def _disk_check(settings: Settings) -> intake.DiskCheck:
    return intake.DiskCheck(Path(settings.output_root), settings.disk_check)


def _feed(ingest: intake.Ingest, batch: list) -> None:
    for item in batch:
        ingest.feed(*item)


def _find_key(sessions: sessionmaker, key: str) -> JobRow | None:
    with sessions() as s:
        return repo.job_by_idempotency_key(s, key)


@router.post(
    "",
    status_code=202,
    response_model=JobOut,
    responses=_problems(413, 415, 422, 507),
    openapi_extra=CREATE_BODY,
    summary="Create an extraction job",
    description="Samples inline (`samples`), from a JSONL file under the service's input root "
    "(`input_path`), or streamed as an `application/x-ndjson` body (one sample per line; "
    "then `name` and `layers` come from the query string). All samples are checked before "
    "anything is stored. With an `Idempotency-Key` header, repeating the same request "
    "returns the first job; the same key with another body is a 422.",
)
async def create_job(
    request: Request,
    settings: SettingsDep,
    name: Annotated[str | None, Query(max_length=200, description="job name (NDJSON bodies only)")] = None,
    layers: Annotated[str | None, Query(description="comma-separated layers (NDJSON bodies only)")] = None,
    idempotency_key: Annotated[str | None, Header(max_length=255)] = None,
) -> JobOut:
    media = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    limits = await run_in_threadpool(request.app.state.backend.limits)
    if media == "application/x-ndjson":
        layer_list = None
        if layers is not None:
            try:
                layer_list = check_layers(parse_layers(layers))
            except ValueError as exc:
                raise InvalidInput([{"field": "layers", "message": str(exc)}]) from None
        out = await _create_from_ndjson(request, settings, limits, name, layer_list, idempotency_key)
        _wake_writer(request)
        return out
    if media != "application/json":
        raise ProblemError(415, f"send application/json or application/x-ndjson, not {media!r}")
    raw = b"".join([c async for c in _body_chunks(request, settings.max_json_bytes)])
    try:
        body = JobCreate.model_validate_json(raw)
    except ValidationError as exc:
        raise InvalidInput(errors_from_pydantic(exc.errors())) from None
    digest = hashlib.sha256(b"json\0" + raw).hexdigest()
    out = await run_in_threadpool(
        _create_sync, request.app.state.sessions, settings, limits, body, idempotency_key, digest
    )
    _wake_writer(request)
    return out


def _wake_writer(request: Request) -> None:
    """Committed queued samples: this process's writer starts on them now, not at its next poll."""
    if request.app.state.writer is not None:
        request.app.state.writer.notify_work()


# --- reading ----------------------------------------------------------------------------------


@router.get("", response_model=JobPage, responses=_problems(422), summary="List jobs, newest first")
def list_jobs(
    session: ReadSessionDep,
    state: JobState | None = None,
    after: Annotated[str | None, Query(max_length=40, description="job id the previous page ended with")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> JobPage:
    rows = repo.list_jobs(session, state=state, after=after, limit=limit + 1)
    page = rows[:limit]
    waiting = repo.waiting_reason(session)
    return JobPage(
        data=[job_out(j, waiting) for j in page],
        has_more=len(rows) > limit,
        next_after=page[-1].id if len(rows) > limit else None,
    )


@router.get("/{job_id}", response_model=JobOut, responses=_problems(404), summary="A job's state and progress")
def get_job(job_id: str, session: ReadSessionDep) -> JobOut:
    job = _job(session, job_id)
    return job_out(job, repo.waiting_reason(session))


@router.get(
    "/{job_id}/events",
    responses={
        **_problems(404),
        200: {
            "content": {"text/event-stream": {}},
            "description": "`event: job` with the job as JSON whenever it changes; ends once it is finished",
        },
    },
    response_class=StreamingResponse,
    summary="Live progress as server-sent events",
)
async def job_events(job_id: str, request: Request):
    sessions = request.app.state.read_sessions

    def load() -> JobOut | None:
        with sessions() as s:
            job = repo.get_job(s, job_id)
            return job_out(job, repo.waiting_reason(s)) if job else None

    first = await run_in_threadpool(load)
    if first is None:
        raise NotFound(f"job {job_id!r}")

    async def stream() -> AsyncIterator[bytes]:
        job, last, quiet = first, None, 0.0
        while True:
            text = job.model_dump_json(exclude={"rate_tokens_per_s", "eta_s"})
            if text != last:
                yield f"event: job\ndata: {job.model_dump_json()}\n\n".encode()
                last, quiet = text, 0.0
            elif quiet >= 15:
                yield b": keep-alive\n\n"
                quiet = 0.0
            if job.state in TERMINAL_JOB_STATES or await request.is_disconnected():
                return
            await asyncio.sleep(0.5)
            quiet += 0.5
            job = await run_in_threadpool(load) or job

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@router.get(
    "/{job_id}/samples",
    response_model=SamplePage,
    responses=_problems(404, 422),
    summary="Per-sample state, token counts, attempts, errors and placement",
)
def list_samples(
    job_id: str,
    session: ReadSessionDep,
    state: SampleState | None = None,
    after: Annotated[str | None, Query(max_length=200, description="sample id the previous page ended with")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> SamplePage:
    _job(session, job_id)
    after_idx = None
    if after is not None:
        anchor = repo.get_sample(session, job_id, after)
        if anchor is None:
            raise InvalidInput([{"field": "after", "message": f"no sample {after!r} in this job to continue after"}])
        after_idx = anchor.idx
    rows = repo.list_samples(session, job_id, state=state, after_idx=after_idx, limit=limit + 1)
    page = rows[:limit]
    return SamplePage(
        data=[sample_out(s) for s in page],
        has_more=len(rows) > limit,
        next_after=page[-1].sample_id if len(rows) > limit else None,
    )


# Sample ids may contain "/": they are the last, path-typed part of every URL that names one.
@router.get(
    "/{job_id}/tensors/{sample_id:path}",
    responses={
        **_problems(404, 409),
        200: {
            "content": {"application/octet-stream": {}},
            "description": "safetensors: input_ids, loss_mask, layer_<i>",
        },
    },
    response_class=Response,
    summary="One stored sample's tensors as a small safetensors file",
)
def get_sample_tensors(job_id: str, sample_id: str, session: ReadSessionDep, settings: SettingsDep) -> Response:
    from hsx.manifest import read_rows
    from safetensors.torch import save

    job = _job(session, job_id)
    s = repo.get_sample(session, job_id, sample_id)
    if s is None:
        raise NotFound(f"sample {sample_id!r}")
    if s.state != "succeeded":
        raise ProblemError(409, f"sample {sample_id!r} is {s.state}, not stored")
    layers = (job.model_info or {}).get("layers", [])
    tensors = read_rows(job_dir(settings.output_root, job_id) / s.shard, s.shard_offset, s.num_tokens, layers)
    data = save({k: v.contiguous() for k, v in tensors.items()}, metadata={"sample_id": s.sample_id, "job_id": job_id})
    return Response(
        data,
        media_type="application/octet-stream",
        headers={"Content-Disposition": f'attachment; filename="sample-{s.idx}.safetensors"'},
    )


@router.get(
    "/{job_id}/samples/{sample_id:path}",
    response_model=SampleOut,
    responses=_problems(404),
    summary="One sample, with every attempt and its outcome",
)
def get_sample(job_id: str, sample_id: str, session: ReadSessionDep) -> SampleOut:
    _job(session, job_id)
    s = repo.get_sample(session, job_id, sample_id)
    if s is None:
        raise NotFound(f"sample {sample_id!r}")
    return sample_out(s, repo.sample_attempts(session, s.pk))


@router.get(
    "/{job_id}/manifest",
    responses=_problems(404),
    summary="The job's manifest: model, layers, shards (with sha256) and where each sample lies",
)
def get_manifest(job_id: str, session: ReadSessionDep) -> dict:
    return build_manifest(session, _job(session, job_id)).model_dump(mode="json")


RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


@router.get(
    "/{job_id}/shards/{name}",
    responses={
        **_problems(404, 416),
        200: {"content": {"application/octet-stream": {}}, "description": "the shard (safetensors); Range supported"},
    },
    response_class=FileResponse,
    summary="Download one shard; supports Range, ETag (its sha256) and If-None-Match",
)
def get_shard(job_id: str, name: str, session: ReadSessionDep, settings: SettingsDep, request: Request):
    _job(session, job_id)
    # Only names recorded in the database are served, so no path from the URL reaches the disk.
    shard = repo.get_shard(session, job_id, name)
    if shard is None:
        raise NotFound(f"shard {name!r}")
    etag = f'"{shard.sha256}"'
    headers = {"ETag": etag, "X-Content-SHA256": shard.sha256, "Cache-Control": "private, max-age=0"}
    if request.headers.get("if-none-match") in (etag, "*"):
        return Response(status_code=304, headers=headers)
    wanted = request.headers.get("range")
    if wanted is not None:
        m = RANGE.match(wanted.strip())
        if m and m.group(1) and int(m.group(1)) >= shard.bytes:
            raise ProblemError(
                416,
                f"range starts past the end of the {shard.bytes}-byte shard",
                headers={"Content-Range": f"bytes */{shard.bytes}"},
            )
    path = job_dir(settings.output_root, job_id) / shard.name
    return FileResponse(path, media_type="application/octet-stream", filename=shard.name, headers=headers)


# --- actions ----------------------------------------------------------------------------------


@router.post(
    "/{job_id}/cancel",
    response_model=JobOut,
    responses=_problems(404, 409),
    summary="Cancel: queued samples are cancelled; the one in flight finishes and is stored",
)
def cancel_job(job_id: str, session: SessionDep, settings: SettingsDep) -> JobOut:
    with session.begin():
        job = _job(session, job_id)
        cancelled = repo.cancel_job(session, job_id)
        if cancelled is None:
            raise ProblemError(
                409,
                f"job is {job.state}; only queued or running jobs can be cancelled",
                type_="/problems/invalid-transition",
            )
        # Nothing in flight: it ends now (else the writer ends it once its in-flight sample is stored).
        finish_job(session, job_id, settings.output_root)
        session.refresh(cancelled)
        return job_out(cancelled)


@router.post(
    "/{job_id}/retry",
    response_model=JobOut,
    responses=_problems(404, 409),
    summary="Queue the job's failed samples again, with a fresh attempt budget",
)
def retry_job(job_id: str, session: SessionDep, request: Request) -> JobOut:
    with session.begin():
        job = _job(session, job_id)
        if repo.retry_failed(session, job_id) is None:
            why = "it has no failed samples" if job.n_failed == 0 else f"it is {job.state}"
            raise ProblemError(409, f"job cannot be retried: {why}", type_="/problems/invalid-transition")
        session.refresh(job)
        out = job_out(job)
    _wake_writer(request)
    return out


@router.delete(
    "/{job_id}",
    status_code=204,
    response_class=Response,
    responses=_problems(404, 409),
    summary="Delete a finished job's records, and with delete_files=true its shards and manifest",
)
def delete_job(job_id: str, session: SessionDep, settings: SettingsDep, delete_files: bool = False) -> Response:
    with session.begin():
        job = _job(session, job_id)
        done = repo.delete_job(session, job_id)
        if not done:
            raise ProblemError(
                409, f"job is {job.state}; cancel it or let it finish first", type_="/problems/invalid-transition"
            )
    if delete_files:
        shutil.rmtree(job_dir(settings.output_root, job.id), ignore_errors=True)
    return Response(status_code=204)


@router.post(
    "/{job_id}/verify",
    responses=_problems(404, 409),
    summary="Check every shard's sha256 and every sample's shapes, dtype and finite values",
)
def verify(job_id: str, session: ReadSessionDep, settings: SettingsDep) -> dict:
    from hsx.verify import verify_job

    job = _job(session, job_id)
    folder = job_dir(settings.output_root, job.id)
    if not (folder / "manifest.json").exists():
        raise ProblemError(
            409,
            f"job is {job.state}; its manifest is written once it is finished",
            type_="/problems/invalid-transition",
        )
    return verify_job(folder).to_dict()

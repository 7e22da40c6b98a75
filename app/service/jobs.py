"""Jobs: creating them from submitted samples, acting on them, and their files under the output root."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from functools import partial
from pathlib import Path
from typing import AsyncIterable

from anyio.to_thread import run_sync
from hsx.api.schemas import JobCreate
from hsx.config import Settings
from hsx.db import repository as repo
from hsx.db.models import JobRow, SampleRow, ShardRow
from hsx.extraction.finishing import finish_job
from hsx.manifest import MANIFEST_NAME, Manifest, build_manifest, job_dir
from hsx.names import shown
from hsx.service import intake
from hsx.service.backend_info import BackendInfo
from hsx.service.errors import IdempotencyKeyReused, InvalidInput, InvalidTransition, NotFound, ShardsMissing
from pydantic import ValidationError
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker


def get_job(*, session: Session, job_id: str) -> JobRow:
    """The job, or NotFound."""
    job = repo.get_job(session, job_id)
    if job is None:
        raise NotFound(f"job {shown(job_id)}")
    return job


def get_sample(*, session: Session, job_id: str, sample_id: str) -> SampleRow:
    """The job's sample, or NotFound (for the job first)."""
    get_job(session=session, job_id=job_id)
    sample = repo.get_sample(session, job_id, sample_id)
    if sample is None:
        raise NotFound(f"sample {shown(sample_id)}")
    return sample


def create_job(
    *,
    sessions: sessionmaker[Session],
    settings: Settings,
    backend: BackendInfo,
    body: bytes,
    idempotency_key: str | None,
) -> JobRow:
    """A job from an application/json body: samples inline, or a JSONL file under the input root."""
    try:
        request = JobCreate.model_validate_json(body)
    except ValidationError as exc:
        raise InvalidInput.from_pydantic(exc.errors()) from None
    digest = hashlib.sha256(b"json\0" + body).hexdigest()
    if idempotency_key:
        existing = _job_with_key(sessions, idempotency_key)
        if existing is not None:
            return _replayed(existing, digest)
    limits = backend.limits()
    if request.input_path is not None:
        path = intake.resolve_input_path(settings.input_root, request.input_path)
        items = intake.numbered_lines(intake.file_lines(path, request.input_path))
    else:
        items = intake.body_items(request.samples or [])
    try:
        with sessions.begin() as session:
            ingest = intake.Ingest(
                session,
                limits,
                name=request.name,
                layers=request.layers,
                idempotency_key=idempotency_key,
                request_sha256=digest,
                disk=_disk_check(settings),
            )
            for item in items:
                ingest.feed(*item)
            return ingest.finish()
    except IntegrityError:
        existing = _job_with_key(sessions, idempotency_key) if idempotency_key else None
        if existing is None:
            raise
        return _replayed(existing, digest)  # a concurrent request with the same key won the race


async def create_job_from_ndjson(
    *,
    sessions: sessionmaker[Session],
    settings: Settings,
    backend: BackendInfo,
    name: str | None,
    layers: list[int] | None,
    idempotency_key: str | None,
    body: AsyncIterable[bytes],
) -> JobRow:
    """A job from an application/x-ndjson body, one sample per line, checked and stored as it streams."""
    digest = hashlib.sha256(json.dumps(["ndjson", name, layers]).encode())
    lines = intake.split_lines(body, digest)
    if idempotency_key:
        existing = await run_sync(_job_with_key, sessions, idempotency_key)
        if existing is not None:
            async for _ in lines:  # the whole body, for its digest
                pass
            return _replayed(existing, digest.hexdigest())
    limits = await run_sync(backend.limits)
    session = sessions()
    try:
        session.begin()
        ingest = await run_sync(
            partial(
                intake.Ingest,
                session,
                limits,
                name=name,
                layers=layers,
                idempotency_key=idempotency_key,
                disk=_disk_check(settings),
            )
        )
        batch: list = []
        index, lineno = 0, 0
        async for line in lines:
            lineno += 1
            if not line.strip():
                continue
            batch.append(intake.parse_line(index, lineno, line))
            index += 1
            if len(batch) >= intake.BATCH:
                await run_sync(_feed, ingest, batch)
                batch = []
        await run_sync(_feed, ingest, batch)
        ingest.builder.job.request_sha256 = digest.hexdigest()
        job = await run_sync(ingest.finish)
        await run_sync(session.commit)
        return job
    except IntegrityError:
        await run_sync(session.rollback)
        existing = await run_sync(_job_with_key, sessions, idempotency_key) if idempotency_key else None
        if existing is None:
            raise
        return _replayed(existing, digest.hexdigest())  # a concurrent request with the same key won the race
    except BaseException:
        await run_sync(session.rollback)
        raise
    finally:
        await run_sync(session.close)


def cancel_job(*, session: Session, job_id: str, output_root: Path) -> JobRow:
    """Cancel its queued samples; with nothing in flight it ends now, its manifest written."""
    with session.begin():
        job = get_job(session=session, job_id=job_id)
        cancelled = repo.cancel_job(session, job_id)
        if cancelled is None:
            raise InvalidTransition(f"job is {job.state}; only queued or running jobs can be cancelled")
        # Else the writer ends it once its in-flight sample is stored.
        finish_job(session, job_id, output_root)
        session.refresh(cancelled)
        return cancelled


def retry_job(*, session: Session, job_id: str) -> JobRow:
    """Queue its failed samples again, with a fresh attempt budget."""
    with session.begin():
        job = get_job(session=session, job_id=job_id)
        if repo.retry_failed(session, job_id) is None:
            why = "it has no failed samples" if job.n_failed == 0 else f"it is {job.state}"
            raise InvalidTransition(f"job cannot be retried: {why}")
        session.refresh(job)
        return job


def delete_job(*, session: Session, job_id: str, output_root: Path, delete_files: bool) -> None:
    """Delete a finished job's records and, with delete_files, its folder of shards and manifest."""
    with session.begin():
        job = get_job(session=session, job_id=job_id)
        if not repo.delete_job(session, job_id):
            raise InvalidTransition(f"job is {job.state}; cancel it or let it finish first")
    if delete_files:
        shutil.rmtree(job_dir(output_root, job_id), ignore_errors=True)


def shard_file(*, session: Session, job_id: str, name: str, output_root: Path) -> tuple[ShardRow, Path, os.stat_result]:
    """A written shard's record, file and the file's stat; only names recorded in the database lead to
    the disk. A recorded shard whose file is gone is ShardsMissing (410)."""
    get_job(session=session, job_id=job_id)
    shard = repo.get_shard(session, job_id, name)
    if shard is None:
        raise NotFound(f"shard {shown(name)}")
    path = job_dir(output_root, job_id) / shard.name
    try:
        return shard, path, path.stat()
    except FileNotFoundError:
        raise ShardsMissing(job_id, [shard.name]) from None


def job_manifest(*, session: Session, job_id: str, output_root: Path) -> Manifest:
    """The job's manifest as the database has it; ShardsMissing (410) when a shard it names is no
    longer in the output root, since a reader could not follow it to the rows."""
    job = get_job(session=session, job_id=job_id)
    manifest = build_manifest(session, job)
    folder = job_dir(output_root, job.id)
    missing = [s.name for s in manifest.shards if not (folder / s.name).is_file()]
    if missing:
        raise ShardsMissing(job.id, missing)
    return manifest


def verify_job(*, session: Session, job_id: str, output_root: Path) -> dict:
    """The verification report of a finished job's folder against its manifest."""
    job = get_job(session=session, job_id=job_id)
    folder = job_dir(output_root, job.id)
    if not (folder / MANIFEST_NAME).exists():
        raise InvalidTransition(f"job is {job.state}; its manifest is written once it is finished")
    from hsx.verify import verify_job as verify_folder  # imports torch: only once there is a folder to check

    return verify_folder(folder).to_dict()


def _job_with_key(sessions: sessionmaker[Session], key: str) -> JobRow | None:
    with sessions() as session:
        return repo.job_by_idempotency_key(session, key)


def _replayed(job: JobRow, request_sha256: str) -> JobRow:
    """The job a request whose Idempotency-Key was seen before gets, if it is the same request."""
    if job.request_sha256 != request_sha256:
        raise IdempotencyKeyReused()
    return job


def _disk_check(settings: Settings) -> intake.DiskCheck:
    return intake.DiskCheck(Path(settings.output_root), settings.disk_check)


def _feed(ingest: intake.Ingest, batch: list) -> None:
    for item in batch:
        ingest.feed(*item)

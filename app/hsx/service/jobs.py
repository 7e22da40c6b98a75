"""Jobs: creating them from submitted samples, acting on them, and their files under the output root."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import AsyncIterable, Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

from anyio.to_thread import run_sync
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from hsx.config import Settings, tokenizer_refusal
from hsx.db import repository as repo
from hsx.db.models import JobRow, SampleRow, ShardRow
from hsx.extraction.finishing import finish_job
from hsx.layers import ANY_LAYERS, DEFAULT_LAYER_SET, resolve, set_names
from hsx.manifest import MANIFEST_NAME, Manifest, build_manifest, job_dir
from hsx.matching import SEED_NEEDS, preparing_refusal
from hsx.names import shown
from hsx.service import intake, json_body
from hsx.service.backend_info import BackendInfo, job_limits
from hsx.service.errors import (
    ContentTooLarge,
    IdempotencyKeyReused,
    InvalidInput,
    InvalidTransition,
    NotFound,
    ShardsDeleted,
    ShardsMissing,
)
from hsx.service.leftovers import job_folder, remove_leftover_folder
from hsx.service.lines import LineTooLongError
from hsx.service.shard_check import check_served
from hsx.states import TERMINAL_JOB_STATES, JobState
from hsx.verify import verify_job as verify_folder
from hsx.wire import JobOptions

# A streamed body goes to the worker thread in blocks of about this many bytes.
FEED_BYTES = 1024 * 1024


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
    body: bytes | bytearray,
    idempotency_key: str | None,
) -> JobRow:
    """A job from an application/json body: samples inline, or a JSONL file under the input root."""
    digest = hashlib.sha256(b"json\0")
    digest.update(body)
    request, samples = json_body.job_request(body)
    if idempotency_key:
        existing = _job_with_key(sessions, idempotency_key)
        if existing is not None:
            return _replayed(existing, digest.hexdigest())
    options = JobOptions.model_validate(request.model_dump(include=set(JobOptions.model_fields)))
    check_feed(settings, options)
    check_tokenizer(sessions, settings, options)
    check_regenerate(sessions, options)
    layers = request.layers if request.layers is not None else DEFAULT_LAYER_SET
    check_layers_fit(sessions, layers)
    limits = job_limits(backend, sessions, layers)
    ingest = intake.Ingest(limits, options)
    try:
        if request.input_path is not None:
            path = intake.resolve_input_path(settings.input_root, request.input_path)
            intake.ingest_file(ingest, path, settings.max_sample_bytes, request.input_path)
        else:
            for index, text in samples:
                if len(text) > settings.max_sample_bytes:
                    raise ContentTooLarge(
                        f"sample {index} is longer than the limit of {settings.max_sample_bytes} bytes "
                        "(--max-sample-bytes)",
                        limit=settings.max_sample_bytes,
                        sample_index=index,
                    )
                ingest.feed(*intake.parse_sample(index, text, {}))
        return _store(
            sessions,
            settings,
            ingest,
            name=request.name,
            layers=layers,
            idempotency_key=idempotency_key,
            request_sha256=digest.hexdigest(),
        )
    finally:
        ingest.close()


async def create_job_from_ndjson(
    *,
    sessions: sessionmaker[Session],
    settings: Settings,
    backend: BackendInfo,
    name: str | None,
    layers: list[int] | str,
    idempotency_key: str | None,
    body: AsyncIterable[bytes],
    options: JobOptions | None = None,
    admitted: Callable[[], AbstractAsyncContextManager[object]] = nullcontext,
) -> JobRow:
    """A job from an application/x-ndjson body, one sample per line, checked as it streams.

    The event loop only receives the body: lines are cut, parsed, checked and spooled on a worker
    thread, a block of chunks at a time, and the samples are stored once the body has ended. The
    database is used before the body is read and once it is whole, each time inside `admitted()` (the
    API's slot for a request's database work), never while the body arrives."""
    options = options or JobOptions()
    digest = hashlib.sha256(json.dumps(["ndjson", name, layers, options.model_dump(mode="json")]).encode())
    check_feed(settings, options)
    async with admitted():
        existing = await run_sync(_job_with_key, sessions, idempotency_key) if idempotency_key else None
        if existing is None:
            await run_sync(check_tokenizer, sessions, settings, options)
            await run_sync(check_regenerate, sessions, options)
            await run_sync(check_layers_fit, sessions, layers)
            limits = await run_sync(job_limits, backend, sessions, layers)
    if existing is not None:
        async for chunk in body:  # the whole body, for its digest
            digest.update(chunk)
        return _replayed(existing, digest.hexdigest())
    ingest = intake.Ingest(limits, options)
    try:
        reader = intake.JsonlReader(ingest, settings.max_sample_bytes, digest)
        try:
            block: list[bytes] = []
            held = 0
            async for chunk in body:
                block.append(chunk)
                held += len(chunk)
                if held >= FEED_BYTES:
                    await run_sync(reader.feed, block)
                    block, held = [], 0
            await run_sync(reader.feed, block)
            await run_sync(reader.end)
        except LineTooLongError as exc:
            raise ContentTooLarge(
                f"line {exc.lineno} is longer than the limit of {exc.limit} bytes (--max-sample-bytes)",
                limit=exc.limit,
                line=exc.lineno,
            ) from None
        # The digest is complete only now: a request that loses the race for its Idempotency-Key
        # compares the whole body with the winner's.
        async with admitted():
            return await run_sync(
                partial(
                    _store,
                    sessions,
                    settings,
                    ingest,
                    name=name,
                    layers=layers,
                    idempotency_key=idempotency_key,
                    request_sha256=digest.hexdigest(),
                )
            )
    finally:
        ingest.close()


def check_feed(settings: Settings, options: JobOptions) -> None:
    """A back-pressure limit below one shard would stop the job before its first shard could be read."""
    if options.max_unread_bytes is not None and options.max_unread_bytes < settings.shard_max_bytes:
        message = (
            f"{options.max_unread_bytes} bytes is less than one shard ({settings.shard_max_bytes} bytes, "
            "--shard-max-bytes): the job could never be read far enough to go on"
        )
        raise InvalidInput([{"field": "max_unread_bytes", "message": message}])


def check_regenerate(sessions: sessionmaker[Session], options: JobOptions) -> None:
    """A job that regenerates answers is refused when live writers run, all have said what their server is,
    and none of them may (their server does not generate for hsx, or ignores the seed the job samples with);
    otherwise it waits, saying what it needs (hsx.matching.Waiting)."""
    if options.regenerate is None:
        return
    with sessions() as session:
        writers = repo.present_writers(session)
    # A writer still finding out what its server is may turn out to generate: refused only once all have said.
    said = bool(writers) and all((w.server or {}).get("source") is not None for w in writers)
    why = preparing_refusal(options.model_dump(mode="json"), writers) if said else None
    if why is not None:
        field = "regenerate.seed" if why.startswith(SEED_NEEDS) else "regenerate"
        raise InvalidInput([{"field": field, "message": why}])


def check_layers_fit(sessions: sessionmaker[Session], layers: list[int] | str) -> None:
    """A job's layers are refused when live writers run, all have said their model's depth, and the job's
    sets or ids fit none of those models (a set needs more layers than the model has, an id lies beyond its
    depth); otherwise it waits for a worker that gives them, saying what it needs (hsx.matching.Waiting)."""
    if layers == ANY_LAYERS:
        return
    with sessions() as session:
        said = [(w.server or {}).get("num_hidden_layers") for w in repo.present_writers(session)]
    depths = sorted({d for d in said if isinstance(d, int)})
    if not said or len(depths) < len(set(said)):
        return
    why = []
    for depth in depths:
        try:
            resolve(layers, depth)
            return
        except ValueError as exc:
            why.append(str(exc))
    raise InvalidInput(
        [
            {
                "field": "layers",
                "message": f"{'; '.join(why)} (the live workers' models; the layer sets are {set_names()}, "
                f"each for a model of any depth it fits)",
            }
        ]
    )


def check_tokenizer(sessions: sessionmaker[Session], settings: Settings, options: JobOptions) -> None:
    """A job's `tokenizer`, when it names one, must be a folder under the tokenizer roots or the model
    path a live writer's server reports (hsx.config.tokenizer_refusal); InvalidInput otherwise."""
    if options.tokenizer is None:
        return
    with sessions() as session:
        model_paths = repo.reported_model_paths(session)
    why = tokenizer_refusal(options.tokenizer, settings.tokenizer_root_list(), model_paths)
    if why is not None:
        raise InvalidInput([{"field": "tokenizer", "message": why}])


def _store(
    sessions: sessionmaker[Session],
    settings: Settings,
    ingest: intake.Ingest,
    *,
    name: str | None,
    layers: list[int] | str,
    idempotency_key: str | None,
    request_sha256: str,
) -> JobRow:
    """Store a fully read and checked request's job in one transaction; a concurrent request with the
    same Idempotency-Key that committed first makes this one a replay of it."""
    spool = ingest.finish()
    try:
        with sessions.begin() as session:
            job = intake.store(
                session,
                spool,
                ingest.limits,
                name=name,
                layers=layers,
                idempotency_key=idempotency_key,
                request_sha256=request_sha256,
                disk=_disk_check(settings),
                options=ingest.options,
            )
    except IntegrityError:
        existing = _job_with_key(sessions, idempotency_key) if idempotency_key else None
        if existing is None:
            raise
        return _replayed(existing, request_sha256)
    if not (job.n_queued or job.n_preparing):
        return _end_at_once(sessions, settings, job.id)
    return job


def _end_at_once(sessions: sessionmaker[Session], settings: Settings, job_id: str) -> JobRow:
    """A job whose every sample was skipped has nothing for a writer to claim, so no writer would
    ever end it: it ends here (failed, saying why), with its manifest as every finished job."""
    with sessions.begin() as session:
        finish_job(session, job_id, Path(settings.output_root))
    with sessions() as session:
        return get_job(session=session, job_id=job_id)


def cancel_job(*, session: Session, job_id: str) -> JobRow:
    """Mark the job cancelling, at once whatever its size: its queued samples are cancelled in the
    background (hsx.service.cancelling), which ends the job once none of its samples is in flight.
    A job already cancelling is returned as it is; a finished one cannot be cancelled."""
    with session.begin():
        get_job(session=session, job_id=job_id)
        cancelled = repo.cancel_job(session, job_id)
        if cancelled is not None:
            return cancelled
        job = get_job(session=session, job_id=job_id)  # as the lock found it
        if job.state != JobState.CANCELLING:
            raise InvalidTransition(f"job is {job.state}; only queued or running jobs can be cancelled")
        return job


def retry_job(*, session: Session, job_id: str) -> JobRow:
    """Queue again what the job has not stored (its failed samples; a cancelled job's cancelled ones too),
    with a fresh attempt budget: the job goes on from where it stopped (repo.retry_job)."""
    with session.begin():
        job = get_job(session=session, job_id=job_id)
        if repo.retry_job(session, job_id) is None:
            if job.state == JobState.CANCELLING:
                why = "it is cancelling; once it is cancelled, a retry resumes it"
            else:
                why = f"it is {job.state} with no failed or cancelled samples"
            raise InvalidTransition(f"job cannot be retried: {why}")
        session.refresh(job)
        return job


def delete_job(*, session: Session, job_id: str, output_root: Path, delete_files: bool) -> None:
    """Delete a finished job's records and, with delete_files, its folder of shards and manifest, when
    that is plainly hsx's (hsx.service.leftovers): else ForeignFiles, and nothing is deleted, the
    records included. With delete_files, a job whose records were deleted before (without its files)
    has its folder removed under the same rule; NotFound when there are neither records nor folder."""
    folder = None
    with session.begin():
        try:
            job: JobRow | None = get_job(session=session, job_id=job_id)
        except NotFound:
            job = None
        deleted = None if job is None else repo.delete_job(session, job_id)
        if job is not None and deleted is False:
            how = "wait until it is cancelled" if job.state == JobState.CANCELLING else "cancel it or let it finish"
            raise InvalidTransition(f"job is {job.state}; {how} first")
        if deleted and delete_files:
            folder = job_folder(output_root, job_id)  # ForeignFiles here rolls the records' deletion back
    if deleted is None:
        # No records (never, or deleted before, perhaps by a request that raced this one): only a folder
        # they left can be deleted.
        if not (delete_files and remove_leftover_folder(output_root, job_id)):
            raise NotFound(f"job {shown(job_id)}")
        return
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def shard_file(*, session: Session, job_id: str, name: str, output_root: Path) -> tuple[ShardRow, Path, os.stat_result]:
    """A written shard's record, file and the file's stat; only names recorded in the database lead to
    the disk. A recorded shard whose file is gone is ShardsMissing (410); one that is no longer the file
    its record describes (size, sha256: hsx.service.shard_check) is ShardDamaged (500)."""
    get_job(session=session, job_id=job_id)
    shard = repo.get_shard(session, job_id, name)
    if shard is None:
        raise NotFound(f"shard {shown(name)}")
    if shard.deleted_at is not None:
        raise ShardsDeleted(job_id, [shard.name])
    path = job_dir(output_root, job_id) / shard.name
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise ShardsMissing(job_id, [shard.name]) from None
    check_served(job_id, shard, path, stat)
    return shard, path, stat


def job_manifest(*, session: Session, job_id: str, output_root: Path) -> Manifest:
    """The job's manifest as the database has it; ShardsMissing (410) when a shard it names is no
    longer in the output root, since a reader could not follow it to the rows."""
    job = get_job(session=session, job_id=job_id)
    manifest = build_manifest(session, job)
    folder = job_dir(output_root, job.id)
    missing = [s.name for s in manifest.shards if not s.deleted and not (folder / s.name).is_file()]
    if missing:
        raise ShardsMissing(job.id, missing)
    return manifest


def verify_job(*, session: Session, job_id: str, output_root: Path) -> dict[str, Any]:
    """The verification report of a finished job's folder against its manifest."""
    job = get_job(session=session, job_id=job_id)
    folder = job_dir(output_root, job.id)
    if not (folder / MANIFEST_NAME).exists():
        if job.state in TERMINAL_JOB_STATES:
            # Finished, so its manifest was written: the folder was removed or moved since, as for a shard.
            shards = [s.name for s in repo.job_shards(session, job.id)]
            raise ShardsMissing(job.id, [MANIFEST_NAME, *shards])
        raise InvalidTransition(f"job is {job.state}; its manifest is written once it is finished")
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

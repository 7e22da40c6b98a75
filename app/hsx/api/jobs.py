"""/v1/jobs: create jobs, follow their progress, act on them, fetch manifests, shards and samples."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import FileResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from hsx.api.bodies import job_body
from hsx.api.deps import (
    AdmissionDep,
    BackendDep,
    CancelsDep,
    FeedDep,
    ReadSessionDep,
    ReadSessionsDep,
    SessionDep,
    SessionsDep,
    SettingsDep,
    WriterDep,
)
from hsx.api.downloads import FileDownload, none_match, wanted_ranges
from hsx.api.params import (
    NDJSON_QUERY,
    JobCursor,
    JobId,
    NameQuery,
    OptionsQuery,
    SampleCursor,
    SampleIdPath,
    ShardName,
    exact_query,
)
from hsx.api.problems import problem_responses
from hsx.extraction import Writer
from hsx.layers import DEFAULT_LAYER_SET, parse_choice_text
from hsx.names import shown
from hsx.service import feed as service_feed
from hsx.service import jobs as service
from hsx.service import queries
from hsx.service.errors import Busy, InvalidInput, NotFound, UnsupportedBody
from hsx.service.tensors import sample_tensors
from hsx.service.views import job_out
from hsx.states import TERMINAL_JOB_STATES
from hsx.wire import (
    CLOCK_FIELDS,
    MAX_FEED_LIMIT,
    MAX_FEED_WAIT_S,
    JobOut,
    JobPage,
    JobStateValue,
    SampleOut,
    SamplePage,
    SampleStateValue,
    ShardList,
    Throughput,
)

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


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


# The job's own URL, relative as every Location the service sends (see hsx.api.routing).
CREATED_HEADERS = {"headers": {"Location": {"description": "the job's URL", "schema": {"type": "string"}}}}


# --- creation -------------------------------------------------------------------------------


@router.post(
    "",
    status_code=202,
    response_model=JobOut,
    responses={**problem_responses(413, 415, 507), 202: CREATED_HEADERS},
    openapi_extra=CREATE_BODY,
    summary="Create an extraction job",
    description="Samples inline (`samples`), from a JSONL file under the service's input root "
    "(`input_path`), or streamed as an `application/x-ndjson` body (one sample per line; "
    "then `name`, `layers` and the job's options come from the query string, each at most once: another "
    "parameter, or one given twice, is a 422, whatever the body). A sample is token ids "
    "(`input_ids`, optional `loss_mask`) or a conversation (`messages` or ShareGPT `conversations`), which a "
    "writer renders with the model's chat template before extraction. All samples are checked before "
    "anything is stored. With an `Idempotency-Key` header, repeating the same request "
    "returns the first job; the same key with another body is a 422. Bodies are UTF-8: another `charset` is a "
    "415.",
)
async def create_job(
    request: Request,
    *,
    response: Response,
    settings: SettingsDep,
    sessions: SessionsDep,
    admission: AdmissionDep,
    backend: BackendDep,
    writer: WriterDep,
    name: NameQuery = None,
    layers: Annotated[
        str | None,
        Query(
            description="a named layer set (eagle3, the default; eagle3_pre_norm, dflash, dflash_pre_norm, last, "
            "last_pre_norm, any), or comma-separated sets and layers (eagle3,dflash; 2,4,5,8: digits between single "
            "commas), as JobCreate's `layers` (NDJSON bodies only)"
        ),
    ] = None,
    options: OptionsQuery,
    idempotency_key: Annotated[str | None, Header(max_length=255)] = None,
) -> JobOut:
    media = _media_type(request.headers.get("content-type", "application/json"))
    ndjson = media == "application/x-ndjson"
    # The document declares the NDJSON parameters whatever the body (OpenAPI cannot tie a parameter to a
    # media type), so a JSON body may come with them; anything else, or one given twice, is refused alike.
    exact_query(request.query_params, NDJSON_QUERY, "not a parameter of a job creation")
    async with job_body(request, settings.max_ndjson_bytes if ndjson else settings.max_json_bytes) as body:
        if ndjson:
            job = await service.create_job_from_ndjson(
                sessions=sessions,
                settings=settings,
                backend=backend,
                name=name,
                layers=_layer_list(layers),
                idempotency_key=idempotency_key,
                body=body.chunks(),
                options=options,
                admitted=admission.slot,
            )
        else:
            data = await body.read()
            async with admission.slot():  # for the checks and the store, not while the body arrives
                job = await run_in_threadpool(
                    service.create_job,
                    sessions=sessions,
                    settings=settings,
                    backend=backend,
                    body=data,
                    idempotency_key=idempotency_key,
                )
    _wake(writer)
    response.headers["Location"] = request.scope.get("root_path", "") + f"/v1/jobs/{job.id}"
    return job_out(job)


def _media_type(content_type: str) -> str:
    """The body's media type, one of the two a job is created from, in UTF-8: JSON text is UTF-8
    (RFC 8259), so another charset is refused rather than read as UTF-8."""
    media, *params = (part.strip() for part in content_type.split(";"))
    media = media.lower()
    if media not in ("application/json", "application/x-ndjson"):
        raise UnsupportedBody(f"send application/json or application/x-ndjson, not {media!r}")
    for param in params:
        key, _, value = param.partition("=")
        charset = value.strip().strip('"').lower()
        if key.strip().lower() == "charset" and charset not in ("utf-8", "utf8"):
            raise UnsupportedBody(f"charset {charset!r} is not supported: send the body in UTF-8 (charset=utf-8)")
    return media


def _layer_list(layers: str | None) -> list[int] | str:
    """The `layers` query parameter: a named set, or comma-separated sets and layers; the default set when
    absent."""
    if layers is None:
        return DEFAULT_LAYER_SET
    try:
        return parse_choice_text(layers)
    except ValueError as exc:
        raise InvalidInput([{"field": "layers", "message": str(exc)}]) from None


def _wake(writer: Writer | None) -> None:
    """Committed queued samples: this process's writer starts on them now, not at its next poll."""
    if writer is not None:
        writer.notify_work()


# --- reading ----------------------------------------------------------------------------------


@router.api_route(
    "",
    methods=["GET", "HEAD"],
    response_model=JobPage,
    responses=problem_responses(422),
    summary="List jobs, newest first",
)
def list_jobs(
    session: ReadSessionDep,
    state: JobStateValue | None = None,
    after: JobCursor = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> JobPage:
    return queries.job_page(session=session, state=state, after=after, limit=limit)


@router.api_route(
    "/{job_id}",
    methods=["GET", "HEAD"],
    response_model=JobOut,
    responses=problem_responses(404),
    summary="A job's state and progress",
)
def get_job(job_id: JobId, session: ReadSessionDep) -> JobOut:
    return queries.job_view(session=session, job_id=job_id)


@router.get(
    "/{job_id}/events",
    responses={
        **problem_responses(404),
        200: {
            "content": {"text/event-stream": {}},
            "description": "`event: job` with the job as JSON whenever it changes; ends once it is finished",
        },
    },
    response_class=StreamingResponse,
    summary="Live progress as server-sent events",
)
async def job_events(
    job_id: JobId, request: Request, sessions: ReadSessionsDep, admission: AdmissionDep
) -> StreamingResponse:
    def read() -> JobOut | None:
        with sessions() as s:
            return queries.job_view_if_any(session=s, job_id=job_id)

    async def load() -> JobOut | None:
        # A slot for each look only: between looks the stream holds no connection and no thread.
        async with admission.check():
            return await run_in_threadpool(read)

    first = await load()  # no slot within the wait: a 503, before the stream starts
    if first is None:
        raise NotFound(f"job {shown(job_id)}")

    async def stream() -> AsyncIterator[bytes]:
        job, last, quiet = first, None, 0.0
        while True:
            text = job.model_dump_json(exclude=set(CLOCK_FIELDS))
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
            try:
                latest = await load()
            except Busy:  # the next look will do
                continue
            job = latest or job

    return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@router.api_route(
    "/{job_id}/throughput",
    methods=["GET", "HEAD"],
    response_model=Throughput,
    responses=problem_responses(404, 422),
    summary="What the job extracted over time: samples, tokens and tokens per second in equal windows",
    description="Windows are a multiple of 5 seconds wide, as narrow as `points` allows, from the job's first "
    "extraction to its end (or now).",
)
def get_throughput(
    job_id: JobId,
    session: ReadSessionDep,
    points: Annotated[int, Query(ge=1, le=1000, description="the most windows to return")] = 120,
) -> Throughput:
    return queries.job_throughput(session=session, job_id=job_id, points=points, now=time.time())


@router.api_route(
    "/{job_id}/samples",
    methods=["GET", "HEAD"],
    response_model=SamplePage,
    responses=problem_responses(404),
    summary="Per-sample state, token counts, attempts, errors and placement",
)
def list_samples(
    job_id: JobId,
    session: ReadSessionDep,
    state: SampleStateValue | None = None,
    after: SampleCursor = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> SamplePage:
    return queries.sample_page(session=session, job_id=job_id, state=state, after=after, limit=limit)


# Sample ids may contain "/": they are the last, path-typed part of every URL that names one.
@router.api_route(
    "/{job_id}/tensors/{sample_id:path}",
    methods=["GET", "HEAD"],
    responses={
        **problem_responses(404, 409, 410, 500),
        200: {
            "content": {"application/octet-stream": {}},
            "description": "safetensors: input_ids, loss_mask, layer_<i> [T, hidden] in the job's dtype, whatever "
            "its encoding (a lossless or fp8 job's layers are decoded)",
        },
    },
    response_class=Response,
    summary="One stored sample's tensors as a small safetensors file (GET or HEAD)",
    description="HEAD answers from the shard's header and metadata (the size of the file GET would send) and "
    "decodes nothing. A shard that fails a check on what it holds (where it places the sample, a layer's "
    "index, a frame's size or checksum, an fp8 scale) is a 500 `/problems/shard-damaged` naming the shard, "
    "layer and sample.",
)
def get_sample_tensors(
    job_id: JobId, sample_id: SampleIdPath, session: ReadSessionDep, settings: SettingsDep, request: Request
) -> Response:
    head = request.method == "HEAD"
    sample, cut, data = sample_tensors(
        session=session, job_id=job_id, sample_id=sample_id, output_root=settings.output_root, read=not head
    )
    headers = {"Content-Disposition": f'attachment; filename="sample-{sample.idx}.safetensors"'}
    if head:
        headers["Content-Length"] = str(cut.size)
    return Response(data, media_type="application/octet-stream", headers=headers)


@router.api_route(
    "/{job_id}/samples/{sample_id:path}",
    methods=["GET", "HEAD"],
    response_model=SampleOut,
    responses=problem_responses(404),
    summary="One sample, with every attempt and its outcome",
)
def get_sample(job_id: JobId, sample_id: SampleIdPath, session: ReadSessionDep) -> SampleOut:
    return queries.sample_view(session=session, job_id=job_id, sample_id=sample_id)


@router.api_route(
    "/{job_id}/manifest",
    methods=["GET", "HEAD"],
    responses=problem_responses(404, 410),
    summary="The job's manifest (GET or HEAD): model, layers, shards (with sha256) and where each sample lies",
)
def get_manifest(job_id: JobId, session: ReadSessionDep, settings: SettingsDep) -> dict[str, Any]:
    manifest = service.job_manifest(session=session, job_id=job_id, output_root=settings.output_root)
    return manifest.model_dump(mode="json")


@router.api_route(
    "/{job_id}/shards",
    methods=["GET", "HEAD"],
    response_model=ShardList,
    responses=problem_responses(404, 422),
    summary="The commit feed: shards recorded after a position, in the order recorded; waits for the next",
    description="Every shard a job records takes its next `seq` (1, 2, ...: the order recorded, without gaps, "
    "whichever writer wrote it). This answers the shards after `after` (each with its samples' ids, offsets and "
    "lengths), at most `limit`. With `wait`, a request that finds none waits up to that many seconds for the next "
    "one (or the job's end) before answering. `complete` says the job has ended and nothing follows: a follower "
    "stops there. Pass `last_seq` as the next `after`.",
)
async def list_shards(
    job_id: JobId,
    sessions: ReadSessionsDep,
    feed: FeedDep,
    after: Annotated[int, Query(ge=0, le=2**31 - 1, description="the last seq already seen (0: from the start)")] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_FEED_LIMIT, description="the most shards to answer")] = 1000,
    wait: Annotated[
        float,
        Query(ge=0, le=MAX_FEED_WAIT_S, description="seconds to wait for a shard when none follows `after` yet"),
    ] = 0,
) -> ShardList:
    return await service_feed.follow(watch=feed, sessions=sessions, job_id=job_id, after=after, limit=limit, wait=wait)


@router.api_route(
    "/{job_id}/shards/{name}",
    methods=["GET", "HEAD"],
    responses={
        **problem_responses(404, 410, 416, 500),
        200: {"content": {"application/octet-stream": {}}, "description": "the shard (safetensors)"},
        206: {"description": "the requested byte ranges (Range)"},
        304: {"description": "the shard matches If-None-Match"},
    },
    response_class=FileResponse,
    summary="Download one shard (GET or HEAD); supports Range, If-Range, ETag (its sha256) and If-None-Match",
    description="The file is served only while it is what its record says: a size or sha256 that differs (the "
    "sha256 computed once per version of the file) is a 500 `/problems/shard-damaged`, so the ETag is always "
    "the sha256 of the bytes sent.",
)
def get_shard(
    job_id: JobId, name: ShardName, session: ReadSessionDep, settings: SettingsDep, request: Request
) -> Response:
    shard, path, _ = service.shard_file(session=session, job_id=job_id, name=name, output_root=settings.output_root)
    etag = f'"{shard.sha256}"'
    headers = {"ETag": etag, "X-Content-SHA256": shard.sha256, "Cache-Control": "private, max-age=0"}
    if none_match(request.headers.get("if-none-match"), etag):
        return Response(status_code=304, headers=headers)
    ranges = wanted_ranges(request.headers.get("range"), request.headers.get("if-range"), etag, shard.bytes)
    return FileDownload(
        path, ranges=ranges, media_type="application/octet-stream", filename=shard.name, headers=headers
    )


# --- actions ----------------------------------------------------------------------------------


@router.post(
    "/{job_id}/cancel",
    response_model=JobOut,
    responses=problem_responses(404, 409),
    summary="Cancel: queued samples are cancelled; those in flight finish and are stored",
    description="Answers at once with the job `cancelling`, whatever its size: from then on none of its samples "
    "is started, its queued samples are cancelled in the background (in batches of `--cancel-batch`), and the "
    "samples already running or staged finish and are stored. The job becomes `cancelled`, its manifest "
    "written, once none is queued, running or staged. Cancelling a job that is already `cancelling` returns "
    "it unchanged; a finished job is a 409.",
)
def cancel_job(job_id: JobId, session: SessionDep, cancels: CancelsDep) -> JobOut:
    job = queries.job_answer(session=session, job=service.cancel_job(session=session, job_id=job_id))
    cancels.wake()
    return job


@router.post(
    "/{job_id}/retry",
    response_model=JobOut,
    responses=problem_responses(404, 409),
    summary="Queue again what the job has not stored (failed samples, and a cancelled job's cancelled ones)",
    description="Resumes a `partial`, `failed` or `cancelled` job, or a running one with failed samples: its "
    "failed samples, and the samples a cancel left unrun, are queued again, each with a fresh attempt budget "
    "(conversations never rendered are prepared again); its stored and skipped samples stay as they are. The job "
    "becomes `running` (`queued` if it never started) and goes on where it stopped: its next shard takes the next "
    "name and the next `seq` of its commit feed, whose `complete` is false again until the job ends, and its "
    "manifest, written again when it ends, lists every stored sample once. A 409 while the job is `cancelling`, and "
    "for a job with no failed or cancelled samples.",
)
def retry_job(job_id: JobId, session: SessionDep, writer: WriterDep) -> JobOut:
    job = service.retry_job(session=session, job_id=job_id)
    _wake(writer)
    return queries.job_answer(session=session, job=job)


@router.delete(
    "/{job_id}",
    status_code=204,
    response_class=Response,
    responses=problem_responses(404, 409),
    summary="Delete a finished job's records, and with delete_files=true its shards and manifest",
    description="Only a finished (`succeeded`, `partial`, `failed` or `cancelled`) job: a 409 while it is `queued`, "
    "`running` or `cancelling`. Without delete_files the job's folder stays in the output root; "
    "delete_files=true removes it, with the records or later, once they are gone, as long as it is a folder "
    "holding only what hsx writes there (shards, manifest.json, temporary files); a folder holding anything "
    "else, or a symbolic link in its place, is a 409 (`/problems/foreign-files`, naming them) and nothing is "
    "deleted, the records included. A 404 when there are neither records nor (with delete_files) a folder. Deletes "
    "of one job at once each answer 204 or 404.",
)
def delete_job(job_id: JobId, session: SessionDep, settings: SettingsDep, delete_files: bool = False) -> Response:
    service.delete_job(session=session, job_id=job_id, output_root=settings.output_root, delete_files=delete_files)
    return Response(status_code=204)


@router.post(
    "/{job_id}/verify",
    responses=problem_responses(404, 409, 410),
    summary="Check every shard's sha256 and every sample's shapes, dtype and finite values",
    description="A 409 while the job is not finished; a 410 when its folder (manifest and shards) is no longer "
    "in the output root.",
)
def verify(job_id: JobId, session: ReadSessionDep, settings: SettingsDep) -> dict[str, Any]:
    return service.verify_job(session=session, job_id=job_id, output_root=settings.output_root)

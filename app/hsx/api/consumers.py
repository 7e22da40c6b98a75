"""/v1/jobs/{id}/consumers: the readers of a job's commit feed, and what each has acknowledged."""

from __future__ import annotations

from fastapi import APIRouter, Response

from hsx.api.deps import ReadSessionDep, SessionDep, SettingsDep, WriterDep
from hsx.api.params import ConsumerPath, JobId
from hsx.api.problems import problem_responses
from hsx.service import feed as service
from hsx.wire import AckIn, ConsumerIn, ConsumerList, ConsumerOut

router = APIRouter(prefix="/v1/jobs", tags=["consumers"])


@router.post(
    "/{job_id}/consumers",
    status_code=201,
    response_model=ConsumerOut,
    responses={
        **problem_responses(400, 404),
        200: {"model": ConsumerOut, "description": "registered already: as it is"},
    },
    summary="Register a consumer of the job's shards (idempotent: each rank of a trainer may)",
    description="A consumer is a named reader, a trainer whatever its number of ranks. What its ranks acknowledge "
    "decides which shards retention `acked` deletes and how far `max_unread_bytes` lets extraction run ahead. "
    "201 when registered now, 200 with the consumer as it is when it was already.",
)
def register_consumer(job_id: JobId, body: ConsumerIn, session: SessionDep, response: Response) -> ConsumerOut:
    consumer, created = service.register_consumer(session=session, job_id=job_id, name=body.name)
    if not created:
        response.status_code = 200
    return consumer


@router.get(
    "/{job_id}/consumers",
    response_model=ConsumerList,
    responses=problem_responses(404),
    summary="The job's consumers: each rank's position, what they have read, their lag",
)
def list_consumers(job_id: JobId, session: ReadSessionDep) -> ConsumerList:
    return service.consumer_list(session=session, job_id=job_id)


@router.get(
    "/{job_id}/consumers/{name}",
    response_model=ConsumerOut,
    responses=problem_responses(404),
    summary="One consumer: each rank's position, what it has read, its lag",
)
def get_consumer(job_id: JobId, name: ConsumerPath, session: ReadSessionDep) -> ConsumerOut:
    return service.consumer_view(session=session, job_id=job_id, name=name)


@router.post(
    "/{job_id}/consumers/{name}/acks",
    response_model=ConsumerOut,
    responses=problem_responses(400, 404, 409, 422),
    summary="Acknowledge one rank's position: every shard up to `seq` read in this epoch",
    description="Send it once the trainer's checkpoint that holds this position is saved (HiddenStateStream.ack "
    "does). A position only moves forward: an older one changes nothing. A shard counts as read by the consumer "
    "once every rank (0 .. world_size - 1) has acknowledged past it, and as released in its last epoch. A 409 when "
    "another world_size was acknowledged before; a 422 for a seq past the shards recorded.",
)
def acknowledge(
    job_id: JobId, name: ConsumerPath, body: AckIn, session: SessionDep, settings: SettingsDep, writer: WriterDep
) -> ConsumerOut:
    consumer = service.acknowledge(
        session=session, output_root=settings.output_root, job_id=job_id, name=name, ack=body
    )
    if writer is not None:
        writer.notify_work()  # what was held back for this consumer may go on
    return consumer


@router.delete(
    "/{job_id}/consumers/{name}",
    status_code=204,
    response_class=Response,
    responses=problem_responses(404),
    summary="Forget a consumer: it no longer holds the job back, nor keeps shards on disk",
)
def delete_consumer(
    job_id: JobId, name: ConsumerPath, session: SessionDep, settings: SettingsDep, writer: WriterDep
) -> Response:
    service.remove_consumer(session=session, output_root=settings.output_root, job_id=job_id, name=name)
    if writer is not None:
        writer.notify_work()
    return Response(status_code=204)

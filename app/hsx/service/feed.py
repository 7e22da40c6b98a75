"""A job's commit feed as the API answers it, the long poll that waits for its next shard, and the job's
consumers: registering them, their acknowledgements, and the retention that follows from them.

A long poll waits without a database connection or a worker thread: one `FeedWatch` per process looks
at each watched job's row (its recorded shard count and state) a few times a second, however many
followers wait on that job, and wakes them when it changes. Each look, and each page a poll reads, takes
one of the API's slots for checks (hsx.api.admission), so followers never starve short requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from hsx.db import repository as repo
from hsx.db.models import ConsumerAckRow, ConsumerRow, JobRow, ShardRow
from hsx.extraction.metrics import label
from hsx.manifest import build_manifest, job_dir, manifest_header, write_manifest
from hsx.names import shown
from hsx.service.errors import Busy, InvalidInput, NotFound, ServiceError
from hsx.service.jobs import get_job
from hsx.states import TERMINAL_JOB_STATES
from hsx.wire import AckIn, ConsumerList, ConsumerOut, FeedSample, RankOut, ShardList, ShardOut, utc

log = logging.getLogger("hsx.feed")

# How often a watched job's row is looked at while followers wait on it.
WATCH_POLL_S = 0.25


def shard_out(s: ShardRow, samples: list[repo.Placed]) -> ShardOut:
    return ShardOut(
        name=s.name,
        seq=s.seq,
        bytes=s.bytes,
        sha256=s.sha256,
        num_samples=s.num_samples,
        num_tokens=s.num_tokens,
        created_at=utc(s.created_at),
        deleted=s.deleted_at is not None,
        url=f"/v1/jobs/{s.job_id}/shards/{s.name}",
        samples=[FeedSample(id=p.sample_id, offset=p.offset, num_tokens=p.num_tokens) for p in samples],
    )


def shard_feed(*, session: Session, job_id: str, after: int, limit: int) -> ShardList:
    """The job's shards recorded after `after`, at most `limit`, with whether the feed is complete;
    NotFound for the job, InvalidInput for a position past what it recorded."""
    # The job first: a job read as ended had recorded its every shard, so the shards read next are all.
    job = get_job(session=session, job_id=job_id)
    if after > job.shards_committed:
        message = f"the job has recorded {job.shards_committed} shard(s): no position {after} to continue after"
        raise InvalidInput([{"field": "after", "message": message}])
    rows = repo.feed_shards(session, job_id, after, limit)
    placed = repo.shard_samples(session, job_id, [s.name for s in rows])
    last = rows[-1].seq if rows else after
    ended = job.state in TERMINAL_JOB_STATES
    return ShardList(
        job_id=job.id,
        data=[shard_out(s, placed[s.name]) for s in rows],
        after=after,
        last_seq=last,
        committed=job.shards_committed,
        has_more=last < job.shards_committed,
        complete=ended and last >= job.shards_committed,
        job_state=job.state,
        header=manifest_header(job) if job.model_info else None,
    )


@dataclass
class _Watched:
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    waiters: int = 0
    # (shards recorded, state) as last looked at; the state None once the job is deleted
    seen: tuple[int, str | None] | None = None

    def moved_past(self, after: int) -> bool:
        if self.seen is None:
            return False
        committed, state = self.seen
        return committed > after or state is None or state in TERMINAL_JOB_STATES


# A slot for one look at the database (the API's admission: hsx.api.admission.Admission.check), held for
# the block; Busy when none is free in time.
Check = Callable[[], AbstractAsyncContextManager[None]]


class FeedWatch:
    """Wakes long polls when the job they wait on records a shard or ends (see the module docstring)."""

    def __init__(self, sessions: sessionmaker[Session], check: Check):
        self.sessions = sessions
        self.check = check
        self._jobs: dict[str, _Watched] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}

    async def wait(self, job_id: str, after: int, timeout: float) -> None:
        """Return once the job has recorded more than `after` shards or has ended, or after `timeout` s."""
        deadline = time.monotonic() + timeout
        watched = self._jobs.setdefault(job_id, _Watched())
        watched.waiters += 1
        if job_id not in self._tasks:
            self._tasks[job_id] = asyncio.create_task(self._poll(job_id, watched))
        try:
            while True:
                if watched.moved_past(after):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                watched.changed.clear()
                try:
                    await asyncio.wait_for(watched.changed.wait(), left)
                except asyncio.TimeoutError:
                    return
        finally:
            watched.waiters -= 1

    async def _poll(self, job_id: str, watched: _Watched) -> None:
        try:
            while watched.waiters > 0:
                try:
                    async with self.check():
                        seen = await run_in_threadpool(self._look, job_id)
                except Busy:  # every slot taken: the next look will do
                    await asyncio.sleep(WATCH_POLL_S)
                    continue
                if seen != watched.seen:
                    watched.seen = seen
                    watched.changed.set()
                if seen[1] is None:
                    return
                await asyncio.sleep(WATCH_POLL_S)
        except Exception:  # a database outage: the waiters time out and the next poll starts over
            log.warning("feed watch on job %s stopped", job_id, exc_info=True)
            watched.changed.set()
        finally:
            self._tasks.pop(job_id, None)
            if watched.waiters <= 0:
                self._jobs.pop(job_id, None)

    def _look(self, job_id: str) -> tuple[int, str | None]:
        with self.sessions() as session:
            job = repo.get_job(session, job_id)
            # a job deleted meanwhile ends its followers' waits: their next page answers 404
            return (job.shards_committed, job.state) if job is not None else (0, None)


async def follow(
    *, watch: FeedWatch, sessions: sessionmaker[Session], job_id: str, after: int, limit: int, wait: float
) -> ShardList:
    """The feed page after `after`, waiting up to `wait` seconds for a shard when there is none yet: a
    database slot for each look, none while it waits."""

    def read() -> ShardList:
        with sessions() as session:
            return shard_feed(session=session, job_id=job_id, after=after, limit=limit)

    async def page() -> ShardList:
        async with watch.check():
            return await run_in_threadpool(read)

    first = await page()
    if first.data or first.complete or wait <= 0:
        return first
    await watch.wait(job_id, after, wait)
    return await page()


# --- consumers ----------------------------------------------------------------------------------


def _consumer_view(session: Session, job: JobRow, c: ConsumerRow, acks: list[ConsumerAckRow]) -> ConsumerOut:
    pos = repo.position(acks)
    lag_shards, lag_bytes = repo.bytes_after(session, job.id, pos.read)
    return ConsumerOut(
        job_id=job.id,
        name=c.name,
        created_at=utc(c.created_at),
        world_size=pos.world_size,
        ranks=[RankOut(rank=a.rank, epoch=a.epoch, epochs=a.epochs, seq=a.seq, acked_at=utc(a.acked_at)) for a in acks],
        read_seq=min(pos.read, job.shards_committed),
        released_seq=min(pos.released, job.shards_committed),
        lag_shards=lag_shards,
        lag_bytes=lag_bytes,
    )


def consumer_list(*, session: Session, job_id: str) -> ConsumerList:
    job = get_job(session=session, job_id=job_id)
    acks = repo.consumer_acks(session, job_id)
    return ConsumerList(
        data=[_consumer_view(session, job, c, acks.get(c.name, [])) for c in repo.job_consumers(session, job_id)]
    )


def consumer_view(*, session: Session, job_id: str, name: str) -> ConsumerOut:
    job = get_job(session=session, job_id=job_id)
    consumer = _get_consumer(session, job_id, name)
    return _consumer_view(session, job, consumer, repo.consumer_acks(session, job_id, [name]).get(name, []))


def _get_consumer(session: Session, job_id: str, name: str) -> ConsumerRow:
    found = repo.get_consumer(session, job_id, name)
    if found is None:
        raise NotFound(f"consumer {shown(name)} of job {job_id}")
    return found


def register_consumer(*, session: Session, job_id: str, name: str) -> tuple[ConsumerOut, bool]:
    """The job's consumer of that name, registered now unless it was (then False): every rank of a
    trainer registers the same name at its start."""
    with session.begin():
        job = get_job(session=session, job_id=job_id)
        consumer, created = repo.add_consumer(session, job.id, name)
    return consumer_view(session=session, job_id=job_id, name=consumer.name), created


def acknowledge(*, session: Session, output_root: Path, job_id: str, name: str, ack: AckIn) -> ConsumerOut:
    """Keep one rank's position; with retention acked, delete what every consumer has now released."""
    with session.begin():
        job = get_job(session=session, job_id=job_id)
        _get_consumer(session, job_id, name)
        if ack.seq > job.shards_committed:
            message = f"the job has recorded {job.shards_committed} shard(s): position {ack.seq} is past them"
            raise InvalidInput([{"field": "seq", "message": message}])
        try:
            repo.record_ack(
                session,
                job_id,
                name,
                rank=ack.rank,
                world_size=ack.world_size,
                epoch=ack.epoch,
                epochs=ack.epochs,
                seq=ack.seq,
            )
        except repo.AckRefused as exc:
            raise ServiceError(409, str(exc), type_="/problems/world-size-changed") from None
    apply_retention(session=session, output_root=output_root, job_id=job_id)
    return consumer_view(session=session, job_id=job_id, name=name)


def remove_consumer(*, session: Session, output_root: Path, job_id: str, name: str) -> None:
    """Forget a consumer: what it had not read no longer holds the job back, nor keeps shards on disk."""
    with session.begin():
        get_job(session=session, job_id=job_id)
        if not repo.delete_consumer(session, job_id, name):
            raise NotFound(f"consumer {shown(name)} of job {job_id}")
    apply_retention(session=session, output_root=output_root, job_id=job_id)


def apply_retention(*, session: Session, output_root: Path, job_id: str) -> None:
    """With retention acked: mark released shards deleted, then remove their files. Marked first, so a
    reader never follows a record to a file that is gone; a file left by a crash between the two is
    removed by the next pass. A finished job's manifest.json is written again to say so."""
    with session.begin():
        job = get_job(session=session, job_id=job_id)
        if (job.options or {}).get("retention") != "acked":
            return
        before = {s.name for s in repo.job_shards(session, job_id) if s.deleted_at is not None}
        deleted = repo.mark_released(session, job_id)
    folder = job_dir(output_root, job_id)
    for shard in deleted:
        (folder / shard.name).unlink(missing_ok=True)
    newly = [s.name for s in deleted if s.name not in before]
    if newly:
        log.info("job %s: retention deleted %d shard(s), every consumer having read them", job_id, len(newly))
    if newly and job.state in TERMINAL_JOB_STATES and (folder / "manifest.json").exists():
        with session.begin():
            write_manifest(folder, build_manifest(session, get_job(session=session, job_id=job_id)))


def held_reasons(session: Session, jobs: list[JobRow]) -> dict[str, str]:
    """Why each of these jobs that waits for its consumers does (JobOptions.max_unread_bytes): who has
    read least, how much is unread, the limit."""
    held = repo.held_back_jobs(session, [j.id for j in jobs if j.max_unread_bytes is not None])
    reasons = {}
    for job in jobs:
        if job.id not in held or job.max_unread_bytes is None:
            continue
        unread = {
            name: repo.bytes_after(session, job.id, p.read)[1] for name, p in repo.positions(session, job.id).items()
        }
        if not unread:
            continue
        laggard = max(unread, key=lambda name: unread[name])
        reasons[job.id] = (
            f"waiting for consumers: {_size(unread[laggard])} unread by {laggard}, limit {_size(job.max_unread_bytes)} "
            "(max_unread_bytes); extraction goes on as they acknowledge"
        )
    return reasons


def _size(n: int) -> str:
    """Bytes as people read them in a message (decimal units, as disks are sold)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def consumer_metrics(session: Session) -> list[str]:
    """Prometheus lines for the jobs some consumer reads (those still active, or not yet read by every
    consumer): what is unread, the back-pressure limit, and each consumer's lag in shards and bytes."""
    lines = [
        "# HELP hsx_job_unread_bytes Bytes of a job's recorded shards that some consumer has not read yet.",
        "# TYPE hsx_job_unread_bytes gauge",
    ]
    limits = [
        "# HELP hsx_job_max_unread_bytes A job's back-pressure limit (max_unread_bytes).",
        "# TYPE hsx_job_max_unread_bytes gauge",
    ]
    lags = [
        "# HELP hsx_consumer_lag_shards Recorded shards a consumer has not read yet (every rank).",
        "# TYPE hsx_consumer_lag_shards gauge",
        "# HELP hsx_consumer_lag_bytes Bytes of the recorded shards a consumer has not read yet.",
        "# TYPE hsx_consumer_lag_bytes gauge",
    ]
    shard_lags, byte_lags = [], []
    for job in repo.jobs_with_consumers(session):
        behind = {
            name: repo.bytes_after(session, job.id, p.read) for name, p in repo.positions(session, job.id).items()
        }
        if job.state in TERMINAL_JOB_STATES and not any(n for n, _ in behind.values()):
            continue
        lines.append(f'hsx_job_unread_bytes{{job="{job.id}"}} {job.unread_bytes}')
        if job.max_unread_bytes is not None:
            limits.append(f'hsx_job_max_unread_bytes{{job="{job.id}"}} {job.max_unread_bytes}')
        for name, (shards, nbytes) in behind.items():
            shard_lags.append(f'hsx_consumer_lag_shards{{job="{job.id}",consumer="{label(name)}"}} {shards}')
            byte_lags.append(f'hsx_consumer_lag_bytes{{job="{job.id}",consumer="{label(name)}"}} {nbytes}')
    return lines + limits + lags[:2] + shard_lags + lags[2:] + byte_lags

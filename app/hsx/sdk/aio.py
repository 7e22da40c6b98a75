"""The asynchronous client: AsyncHsxClient, the same methods as HsxClient, awaitable (httpx.AsyncClient)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import httpx

from hsx.sdk._core import (
    CHUNK,
    TRANSIENT,
    Answer,
    BytesSent,
    Call,
    Calls,
    Feed,
    JobBytes,
    JobDownload,
    JobRef,
    Options,
    Poll,
    Report,
    ShardDownload,
    ShardProgress,
    SSEDecoder,
    check_shard_name,
    client_options,
    file_chunks,
    job_events,
    jobs_path,
    long_poll,
    resolve_dest,
    tensors_from_bytes,
    write_atomic,
)
from hsx.sdk.errors import error_from_response
from hsx.sdk.models import (
    Consumer,
    Health,
    Job,
    JobPage,
    Manifest,
    Sample,
    SamplePage,
    Shard,
    ShardList,
    Throughput,
    TokenInfo,
    Worker,
)
from hsx.states import TERMINAL_JOB_STATES
from hsx.wire import AckIn

if TYPE_CHECKING:
    import torch

__all__ = ["AsyncHsxClient"]


async def _achunks(f: IO[bytes], size: int, progress: BytesSent | None = None) -> AsyncIterator[bytes]:
    for chunk in file_chunks(f, size, progress):
        yield chunk


class AsyncHsxClient:
    """The asynchronous twin of HsxClient: same constructor, same methods, each a coroutine (iter_jobs,
    iter_samples and events are async iterators). Use `async with AsyncHsxClient() as hsx: ...`."""

    def __init__(
        self, base_url: str | None = None, *, token: str | None = None, timeout: float = 60.0, **httpx_options: Any
    ):
        options = client_options(base_url, token, timeout, httpx_options)
        self.base_url: str = options["base_url"]
        self._http = httpx.AsyncClient(**options)

    async def __aenter__(self) -> AsyncHsxClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    close = aclose

    async def _send(self, call: Call[Answer], **extra: Any) -> Answer:
        resp = await self._http.request(call.method, call.path, **call.kwargs(), **extra)
        if resp.is_error:
            raise error_from_response(resp)
        return call.parse(resp)

    # --- jobs -------------------------------------------------------------------------------

    async def create_job(
        self,
        samples: list[dict[str, Any]] | None = None,
        *,
        input_path: str | None = None,
        name: str | None = None,
        layers: Sequence[int | str] | str | None = None,
        idempotency_key: str | None = None,
        options: Options = None,
    ) -> Job:
        return await self._send(Calls.create_job(samples, input_path, name, layers, idempotency_key, options))

    async def submit_jsonl(
        self,
        source: str | os.PathLike[str] | IO[bytes],
        *,
        name: str | None = None,
        layers: Sequence[int | str] | str | None = None,
        idempotency_key: str | None = None,
        chunk_size: int = 1 << 16,
        progress: BytesSent | None = None,
        options: Options = None,
    ) -> Job:
        call = Calls.submit_jsonl(name, layers, idempotency_key, options)
        if isinstance(source, (str, os.PathLike)):
            with open(source, "rb") as f:
                return await self._send(call, content=_achunks(f, chunk_size, progress))
        return await self._send(call, content=_achunks(source, chunk_size, progress))

    async def get_job(self, job: JobRef) -> Job:
        return await self._send(Calls.get_job(job))

    async def list_jobs(self, *, state: str | None = None, after: str | None = None, limit: int = 100) -> JobPage:
        return await self._send(Calls.list_jobs(state, after, limit))

    async def iter_jobs(self, *, state: str | None = None, page_size: int = 100) -> AsyncIterator[Job]:
        after = None
        while True:
            page = await self.list_jobs(state=state, after=after, limit=page_size)
            for job in page.data:
                yield job
            if not page.has_more:
                return
            after = page.next_after

    async def cancel(self, job: JobRef) -> Job:
        """Cancel the job; returns at once with the job `cancelling` (its queued samples are cancelled
        in the background, those in flight are stored): `wait(job)` follows it until it is `cancelled`.
        A job already cancelling is returned as it is; a finished one raises Conflict."""
        return await self._send(Calls.cancel(job))

    async def retry(self, job: JobRef) -> Job:
        """Queue again what the job has not stored: its failed samples and, once it is cancelled, the samples
        the cancel left unrun, each with a fresh attempt budget; the job goes on where it stopped (its next
        shards follow its old ones in its feed). Conflict while it is cancelling, or with nothing to retry."""
        return await self._send(Calls.retry(job))

    async def delete(self, job: JobRef, *, files: bool = False) -> None:
        await self._send(Calls.delete(job, files))

    async def wait(
        self,
        job: JobRef,
        *,
        timeout: float | None = None,
        poll_s: float = 0.5,
        max_poll_s: float = 5.0,
        on_progress: Callable[[Job], None] | None = None,
    ) -> Job:
        poll = Poll(job, timeout, poll_s, max_poll_s, on_progress)
        while True:
            try:
                current = await self.get_job(job)
            except TRANSIENT:
                pass
            else:
                if poll.finished(current):
                    return current
            await asyncio.sleep(poll.pause())

    async def events(self, job: JobRef) -> AsyncIterator[Job]:
        async with self._http.stream("GET", jobs_path(job, "events"), headers={"Accept": "text/event-stream"}) as resp:
            if resp.is_error:
                await resp.aread()
                raise error_from_response(resp)
            decoder = SSEDecoder()
            async for line in resp.aiter_lines():
                event = job_events(decoder, line)
                if event is not None:
                    yield event

    async def throughput(self, job: JobRef, *, points: int = 120) -> Throughput:
        return await self._send(Calls.throughput(job, points))

    # --- samples ----------------------------------------------------------------------------

    async def list_samples(
        self, job: JobRef, *, state: str | None = None, after: str | None = None, limit: int = 100
    ) -> SamplePage:
        return await self._send(Calls.list_samples(job, state, after, limit))

    async def iter_samples(
        self, job: JobRef, *, state: str | None = None, page_size: int = 1000
    ) -> AsyncIterator[Sample]:
        after = None
        while True:
            page = await self.list_samples(job, state=state, after=after, limit=page_size)
            for sample in page.data:
                yield sample
            if not page.has_more:
                return
            after = page.next_after

    async def get_sample(self, job: JobRef, sample_id: str) -> Sample:
        return await self._send(Calls.get_sample(job, sample_id))

    async def sample_tensors(self, job: JobRef, sample_id: str) -> dict[str, torch.Tensor]:
        call = Calls.sample_tensors(job, sample_id)
        resp = await self._http.request(call.method, call.path)
        if resp.is_error:
            raise error_from_response(resp)
        return tensors_from_bytes(resp.content)

    # --- results ----------------------------------------------------------------------------

    async def manifest(self, job: JobRef) -> Manifest:
        return await self._send(Calls.manifest(job))

    async def list_shards(self, job: JobRef, *, after: int = 0, limit: int = 1000, wait: float = 0) -> ShardList:
        return await self._send(Calls.list_shards(job, after, limit, wait), **long_poll(self._http.timeout, wait))

    async def follow_shards(self, job: JobRef, *, after: int = 0, wait: float = 30.0) -> AsyncIterator[Shard]:
        feed = Feed(after)
        while not feed.complete:
            try:
                page = await self.list_shards(job, after=feed.after, wait=wait)
            except TRANSIENT:
                await asyncio.sleep(feed.pause())
                continue
            for shard in feed.take(page):
                yield shard

    # --- consumers --------------------------------------------------------------------------

    async def register_consumer(self, job: JobRef, name: str) -> Consumer:
        return await self._send(Calls.register_consumer(job, name))

    async def consumers(self, job: JobRef) -> list[Consumer]:
        return (await self._send(Calls.consumers(job))).data

    async def consumer(self, job: JobRef, name: str) -> Consumer:
        return await self._send(Calls.consumer(job, name))

    async def ack(
        self, job: JobRef, name: str, seq: int, *, rank: int = 0, world_size: int = 1, epoch: int = 1, epochs: int = 1
    ) -> Consumer:
        position = AckIn(rank=rank, world_size=world_size, epoch=epoch, epochs=epochs, seq=seq)
        return await self._send(Calls.ack(job, name, position))

    async def delete_consumer(self, job: JobRef, name: str) -> None:
        await self._send(Calls.delete_consumer(job, name))

    async def download_shard(
        self,
        job: JobRef,
        name: str,
        dest: str | os.PathLike[str] | None = None,
        *,
        sha256: str | None = None,
        size: int | None = None,
        on_progress: ShardProgress | None = None,
    ) -> Path:
        check_shard_name(name)
        if sha256 is None:
            try:
                entry = (await self.manifest(job)).shard(name)
                sha256, size = entry.sha256, entry.bytes
            except KeyError:
                pass
        dl = ShardDownload(name, resolve_dest(dest, name), sha256, size, on_progress)
        if dl.already_done():
            dl.part.unlink(missing_ok=True)
            return dl.dest
        if dl.part_complete():
            return dl.finish()
        return await self._fetch(job, dl)

    async def _fetch(self, job: JobRef, dl: ShardDownload) -> Path:
        async with self._http.stream("GET", jobs_path(job, "shards", dl.name), headers=dl.request_headers()) as resp:
            if resp.status_code == 416 and dl.offset:
                await resp.aread()
            elif resp.is_error:
                await resp.aread()
                raise error_from_response(resp)
            else:
                dl.begin(resp)
                try:
                    async for chunk in resp.aiter_bytes(CHUNK):
                        dl.write(chunk)
                finally:
                    dl.close()
                return dl.finish()
        dl.restart()
        return await self._fetch(job, dl)

    async def download_job(
        self,
        job: JobRef,
        directory: str | os.PathLike[str],
        *,
        on_progress: ShardProgress | None = None,
        progress: JobBytes | None = None,
    ) -> Manifest:
        call = Calls.manifest(job)
        resp = await self._http.request(call.method, call.path)
        if resp.is_error:
            raise error_from_response(resp)
        manifest = Manifest.model_validate_json(resp.content)
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tracker = JobDownload(manifest.shards, progress, on_progress)
        for shard in manifest.shards:
            check_shard_name(shard.name)
            await self.download_shard(
                job,
                shard.name,
                directory / shard.name,
                sha256=shard.sha256,
                size=shard.bytes,
                on_progress=tracker.shard,
            )
            tracker.shard_done(shard.bytes)
        if manifest.state in TERMINAL_JOB_STATES:
            write_atomic(directory / "manifest.json", resp.content)
        return manifest

    async def verify(self, job: JobRef) -> Report:
        return await self._send(Calls.verify(job))

    async def health(self) -> Health:
        return await self._send(Calls.health())

    async def workers(self) -> list[Worker]:
        """Every writer that ever registered with the service's database (GET /v1/workers)."""
        return (await self._send(Calls.workers())).data

    async def token_info(self) -> TokenInfo:
        return await self._send(Calls.token_info())

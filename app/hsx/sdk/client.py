"""The synchronous client (httpx). AsyncHsxClient in hsx.sdk.aio has the same methods, awaitable."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
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
from hsx.sdk.errors import HsxError, error_from_response
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

__all__ = ["HsxClient", "HsxError"]


class HsxClient:
    """A client for the hsx API.

    `base_url` defaults to $HSX_URL, then http://127.0.0.1:8000; `token` (a bearer token) to $HSX_TOKEN.
    Any other keyword goes to `httpx.Client` (e.g. `transport=`, `event_hooks=`, `verify=`). Every method that
    takes a job accepts its id or the Job itself. Error answers raise the HsxError subclass for their status
    (Unauthorized, Forbidden, NotFound, Conflict, PayloadTooLarge, InvalidInput, Unavailable, ServerError).
    """

    def __init__(
        self, base_url: str | None = None, *, token: str | None = None, timeout: float = 60.0, **httpx_options: Any
    ):
        options = client_options(base_url, token, timeout, httpx_options)
        self.base_url: str = options["base_url"]
        self._http = httpx.Client(**options)

    def __getstate__(self) -> dict[str, Any]:
        """A client pickles as its URL, headers (its token among them) and timeout, not its connections: a
        DataLoader worker that unpickles one (HiddenStateStream over HTTP) opens its own."""
        return {"base_url": self.base_url, "headers": dict(self._http.headers), "timeout": self._http.timeout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.base_url = state["base_url"]
        self._http = httpx.Client(base_url=self.base_url, headers=state["headers"], timeout=state["timeout"])

    def __enter__(self) -> HsxClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _send(self, call: Call[Answer], **extra: Any) -> Answer:
        resp = self._http.request(call.method, call.path, **call.kwargs(), **extra)
        if resp.is_error:
            raise error_from_response(resp)
        return call.parse(resp)

    # --- jobs -------------------------------------------------------------------------------

    def create_job(
        self,
        samples: list[dict[str, Any]] | None = None,
        *,
        input_path: str | None = None,
        name: str | None = None,
        layers: Sequence[int | str] | str | None = None,
        idempotency_key: str | None = None,
        options: Options = None,
    ) -> Job:
        """Create a job from inline samples ({"id"?, "input_ids", "loss_mask"?}, or a conversation: {"id"?,
        "messages": [...]} / ShareGPT {"id"?, "conversations": [...]}) or from a JSONL or Parquet file under the
        service's input root (`input_path`). `layers`: a named set ("eagle3", the default; "eagle3_pre_norm",
        "dflash", "dflash_pre_norm", "last", "last_pre_norm", "any"), a list of layers, or a list of sets and layers
        (["eagle3", "dflash"]: their union captured once). `options`: the job's max_length, length_policy,
        on_invalid, loss, tokenizer and regenerate (hsx.wire.JobOptions, or a dict of them). Repeating a request
        with the same `idempotency_key` returns the first job."""
        return self._send(Calls.create_job(samples, input_path, name, layers, idempotency_key, options))

    def submit_jsonl(
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
        """Create a job from a local JSONL file (a path or a binary file object), streamed as
        application/x-ndjson in chunks: the file is never read whole. `progress(bytes_sent)` is called after each
        chunk."""
        call = Calls.submit_jsonl(name, layers, idempotency_key, options)
        if isinstance(source, (str, os.PathLike)):
            with open(source, "rb") as f:
                return self._send(call, content=file_chunks(f, chunk_size, progress))
        return self._send(call, content=file_chunks(source, chunk_size, progress))

    def get_job(self, job: JobRef) -> Job:
        return self._send(Calls.get_job(job))

    def list_jobs(self, *, state: str | None = None, after: str | None = None, limit: int = 100) -> JobPage:
        """One page of jobs, newest first; pass the page's `next_after` as `after` for the next one."""
        return self._send(Calls.list_jobs(state, after, limit))

    def iter_jobs(self, *, state: str | None = None, page_size: int = 100) -> Iterator[Job]:
        """Every job (newest first), page by page."""
        after = None
        while True:
            page = self.list_jobs(state=state, after=after, limit=page_size)
            yield from page.data
            if not page.has_more:
                return
            after = page.next_after

    def cancel(self, job: JobRef) -> Job:
        """Cancel the job; returns at once with the job `cancelling` (its queued samples are cancelled
        in the background, those in flight are stored): `wait(job)` follows it until it is `cancelled`.
        A job already cancelling is returned as it is; a finished one raises Conflict."""
        return self._send(Calls.cancel(job))

    def retry(self, job: JobRef) -> Job:
        """Queue again what the job has not stored: its failed samples and, once it is cancelled, the samples
        the cancel left unrun, each with a fresh attempt budget; the job goes on where it stopped (its next
        shards follow its old ones in its feed). Conflict while it is cancelling, or with nothing to retry."""
        return self._send(Calls.retry(job))

    def delete(self, job: JobRef, *, files: bool = False) -> None:
        """Delete a finished job's records; with files=True also its shards and manifest."""
        self._send(Calls.delete(job, files))

    def wait(
        self,
        job: JobRef,
        *,
        timeout: float | None = None,
        poll_s: float = 0.5,
        max_poll_s: float = 5.0,
        on_progress: Callable[[Job], None] | None = None,
    ) -> Job:
        """Poll until the job is succeeded, partial, failed or cancelled, backing off from `poll_s` to `max_poll_s`;
        call `on_progress(job)` after each poll. Polls through the service or its database restarting (503,
        connection errors). Returns the final job; TimeoutError after `timeout` s."""
        poll = Poll(job, timeout, poll_s, max_poll_s, on_progress)
        while True:
            try:
                current = self.get_job(job)
            except TRANSIENT:
                pass
            else:
                if poll.finished(current):
                    return current
            time.sleep(poll.pause())

    def events(self, job: JobRef) -> Iterator[Job]:
        """The job each time it changes, from the server-sent event stream; ends once it is finished."""
        with self._http.stream("GET", jobs_path(job, "events"), headers={"Accept": "text/event-stream"}) as resp:
            if resp.is_error:
                resp.read()
                raise error_from_response(resp)
            decoder = SSEDecoder()
            for line in resp.iter_lines():
                event = job_events(decoder, line)
                if event is not None:
                    yield event

    def throughput(self, job: JobRef, *, points: int = 120) -> Throughput:
        """What the job extracted over time, in at most `points` equal windows (samples, tokens, tokens/s)."""
        return self._send(Calls.throughput(job, points))

    # --- samples ----------------------------------------------------------------------------

    def list_samples(
        self, job: JobRef, *, state: str | None = None, after: str | None = None, limit: int = 100
    ) -> SamplePage:
        return self._send(Calls.list_samples(job, state, after, limit))

    def iter_samples(self, job: JobRef, *, state: str | None = None, page_size: int = 1000) -> Iterator[Sample]:
        """Every sample of the job in input order (only those in `state` when given), page by page."""
        after = None
        while True:
            page = self.list_samples(job, state=state, after=after, limit=page_size)
            yield from page.data
            if not page.has_more:
                return
            after = page.next_after

    def get_sample(self, job: JobRef, sample_id: str) -> Sample:
        """One sample with every attempt (`attempt_log`) and its reason."""
        return self._send(Calls.get_sample(job, sample_id))

    def sample_tensors(self, job: JobRef, sample_id: str) -> dict[str, torch.Tensor]:
        """A stored sample's tensors as torch tensors: input_ids, loss_mask and layer_<i>, in the job's dtype
        whatever its encoding (the service decodes a lossless or fp8 job's layers)."""
        call = Calls.sample_tensors(job, sample_id)
        resp = self._http.request(call.method, call.path)
        if resp.is_error:
            raise error_from_response(resp)
        return tensors_from_bytes(resp.content)

    # --- results ----------------------------------------------------------------------------

    def manifest(self, job: JobRef) -> Manifest:
        return self._send(Calls.manifest(job))

    def list_shards(self, job: JobRef, *, after: int = 0, limit: int = 1000, wait: float = 0) -> ShardList:
        """One page of the job's commit feed: the shards recorded after `after` (each with its `seq` and its
        samples' ids, offsets and lengths), at most `limit`; with `wait`, waiting up to that many seconds for
        one when none is there yet. Its `last_seq` is the next `after`; `complete` says the feed has ended."""
        return self._send(Calls.list_shards(job, after, limit, wait), **long_poll(self._http.timeout, wait))

    def follow_shards(self, job: JobRef, *, after: int = 0, wait: float = 30.0) -> Iterator[Shard]:
        """Every shard the job records after `after`, as it is recorded, in feed order; ends once the job
        has ended and its last shard was given. The service restarting, or answering 503 meanwhile, is
        waited out: the feed goes on where it was."""
        feed = Feed(after)
        while not feed.complete:
            try:
                page = self.list_shards(job, after=feed.after, wait=wait)
            except TRANSIENT:
                time.sleep(feed.pause())
                continue
            yield from feed.take(page)

    # --- consumers --------------------------------------------------------------------------

    def register_consumer(self, job: JobRef, name: str) -> Consumer:
        """Register a consumer of the job's shards, or return it as it is when registered already."""
        return self._send(Calls.register_consumer(job, name))

    def consumers(self, job: JobRef) -> list[Consumer]:
        return self._send(Calls.consumers(job)).data

    def consumer(self, job: JobRef, name: str) -> Consumer:
        return self._send(Calls.consumer(job, name))

    def ack(
        self, job: JobRef, name: str, seq: int, *, rank: int = 0, world_size: int = 1, epoch: int = 1, epochs: int = 1
    ) -> Consumer:
        """Acknowledge one rank's position: every shard up to `seq` read, in epoch `epoch` of `epochs`. Send it
        once the checkpoint holding that position is saved."""
        position = AckIn(rank=rank, world_size=world_size, epoch=epoch, epochs=epochs, seq=seq)
        return self._send(Calls.ack(job, name, position))

    def delete_consumer(self, job: JobRef, name: str) -> None:
        """Forget a consumer: it no longer holds the job back, nor keeps shards on disk."""
        self._send(Calls.delete_consumer(job, name))

    def download_shard(
        self,
        job: JobRef,
        name: str,
        dest: str | os.PathLike[str] | None = None,
        *,
        sha256: str | None = None,
        size: int | None = None,
        on_progress: ShardProgress | None = None,
    ) -> Path:
        """Download one shard to `dest` (a file, or a folder to put it in; default ./<name>) and return its path.

        Bytes go to `<dest>.part` first; an existing part is resumed with a Range request. The whole file's
        sha256 must match the manifest's (or `sha256`) before the part is renamed into place; a mismatch deletes
        the part and raises ChecksumMismatch. A destination that already holds the shard is left as it is.
        """
        check_shard_name(name)
        if sha256 is None:
            try:
                entry = self.manifest(job).shard(name)
                sha256, size = entry.sha256, entry.bytes
            except KeyError:
                pass  # not listed (yet): the server's X-Content-SHA256 header is checked instead
        dl = ShardDownload(name, resolve_dest(dest, name), sha256, size, on_progress)
        if dl.already_done():
            dl.part.unlink(missing_ok=True)
            return dl.dest
        if dl.part_complete():
            return dl.finish()
        return self._fetch(job, dl)

    def _fetch(self, job: JobRef, dl: ShardDownload) -> Path:
        with self._http.stream("GET", jobs_path(job, "shards", dl.name), headers=dl.request_headers()) as resp:
            if resp.status_code == 416 and dl.offset:
                resp.read()
            elif resp.is_error:
                resp.read()
                raise error_from_response(resp)
            else:
                dl.begin(resp)
                try:
                    for chunk in resp.iter_bytes(CHUNK):
                        dl.write(chunk)
                finally:
                    dl.close()
                return dl.finish()
        dl.restart()  # the part was not a prefix of this shard (416): fetch it whole
        return self._fetch(job, dl)

    def download_job(
        self,
        job: JobRef,
        directory: str | os.PathLike[str],
        *,
        on_progress: ShardProgress | None = None,
        progress: JobBytes | None = None,
    ) -> Manifest:
        """Download every shard the manifest lists (each resumable and sha256-checked) into `directory`; once the
        job is finished, write manifest.json there too (last, atomically), so its presence means the folder is
        complete. Shards already there are not fetched again. Returns the manifest.

        `on_progress(shard, done, total)` follows each shard's bytes; `progress(done, total)` the whole job's
        (shards already there count as done once checked)."""
        call = Calls.manifest(job)
        resp = self._http.request(call.method, call.path)
        if resp.is_error:
            raise error_from_response(resp)
        manifest = Manifest.model_validate_json(resp.content)
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tracker = JobDownload(manifest.shards, progress, on_progress)
        for shard in manifest.shards:
            check_shard_name(shard.name)
            self.download_shard(
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

    def verify(self, job: JobRef) -> Report:
        """Have the service check a finished job's files: every shard's sha256, every sample's shapes, dtype and
        finite values. Returns its report ({"ok", "summary", "job_faults", "shard_faults", "sample_faults",
        "warnings", ...})."""
        return self._send(Calls.verify(job))

    def health(self) -> Health:
        return self._send(Calls.health())

    def workers(self) -> list[Worker]:
        """Every writer that ever registered with the service's database (GET /v1/workers)."""
        return (self._send(Calls.workers())).data

    def token_info(self) -> TokenInfo:
        """Whether the service needs tokens, and what this client's may do (read or write)."""
        return self._send(Calls.token_info())

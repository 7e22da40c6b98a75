"""What the sync and async clients share: configuration, the requests each method sends and how its answer
is read, the server-sent-events decoder, backoff, and the resumable shard download's bookkeeping."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Generic, TypeVar, cast
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from hsx.sdk.errors import ChecksumMismatch, HsxError, Unavailable
from hsx.sdk.models import (
    Consumer,
    ConsumerList,
    Health,
    Job,
    JobPage,
    Manifest,
    ManifestShard,
    Sample,
    SamplePage,
    Shard,
    ShardList,
    Throughput,
    TokenInfo,
    WorkerList,
)
from hsx.states import TERMINAL_JOB_STATES
from hsx.storage.atomic import atomic_file, fsync_path
from hsx.wire import AckIn, JobOptions

log = logging.getLogger("hsx.sdk")

if TYPE_CHECKING:
    import torch

DEFAULT_URL = "http://127.0.0.1:8000"
USER_AGENT = "hsx-sdk/0.1"
CHUNK = 1 << 20

JobRef = Any  # a job id, or a Job (anything with an `id`)
ShardProgress = Callable[[str, int, int], None]  # (shard name, bytes done, bytes total)
BytesSent = Callable[[int], None]  # (bytes sent so far)
JobBytes = Callable[[int, int], None]  # (bytes in the folder so far, bytes of all the job's shards)


def client_options(base_url: str | None, token: str | None, timeout: float, options: dict[str, Any]) -> dict[str, Any]:
    """httpx client arguments: base URL from the argument, HSX_URL or the default; bearer token from the
    argument or HSX_TOKEN."""
    url = (base_url or os.environ.get("HSX_URL") or DEFAULT_URL).rstrip("/")
    token = token if token is not None else os.environ.get("HSX_TOKEN") or None
    headers = {"User-Agent": USER_AGENT, **dict(options.pop("headers", None) or {})}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return {"base_url": url, "timeout": timeout, "headers": headers, **options}


def job_id(job: JobRef) -> str:
    if isinstance(job, str):
        return job
    if isinstance(job, dict):
        return job["id"]
    return job.id


def path_segment(value: Any) -> str:
    """One URL path segment, percent-encoded; "." and ".." too, so that no client normalises them away."""
    text = quote(str(value), safe="")
    return text.replace(".", "%2E") if text in (".", "..") else text


def jobs_path(job: JobRef, *rest: Any) -> str:
    return "/".join(["/v1/jobs", path_segment(job_id(job)), *(path_segment(r) for r in rest)])


def drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


Answer = TypeVar("Answer")
# A verification's report, as the service's hsx.verify writes it (free-form JSON).
Report = dict[str, Any]


@dataclass
class Call(Generic[Answer]):
    """One request and the model its answer is read into (None: no body; dict: the JSON as it is)."""

    method: str
    path: str
    model: type[Answer] | None = None
    params: dict[str, Any] | None = None
    json: Any = None
    headers: dict[str, str] | None = None

    def kwargs(self) -> dict[str, Any]:
        return drop_none({"params": self.params, "json": self.json, "headers": self.headers})

    def parse(self, resp: httpx.Response) -> Answer:
        # `model` fixes Answer: None for no body, a BaseModel read from the JSON, or dict for the JSON itself.
        if self.model is None:
            return cast(Answer, None)
        if issubclass(self.model, BaseModel):
            return cast(Answer, self.model.model_validate_json(resp.content))
        return cast(Answer, resp.json())


def idempotency_header(key: str | None) -> dict[str, str] | None:
    return {"Idempotency-Key": key} if key else None


def layers_param(layers: Sequence[int | str] | str | None) -> str | None:
    """A job's layers as the NDJSON query gives them: a set's name, or sets and layers comma-separated."""
    if layers is None or isinstance(layers, str):
        return layers
    return ",".join(x if isinstance(x, str) else str(int(x)) for x in layers)


class Calls:
    @staticmethod
    def create_job(
        samples: list[dict[str, Any]] | None,
        input_path: str | os.PathLike[str] | None,
        name: str | None,
        layers: Sequence[int | str] | str | None,
        idempotency_key: str | None,
        options: Options = None,
    ) -> Call[Job]:
        body = drop_none(
            {
                "samples": samples,
                "input_path": None if input_path is None else str(input_path),
                "name": name,
                "layers": layers,
                **job_options(options),
            }
        )
        return Call("POST", "/v1/jobs", Job, json=body, headers=idempotency_header(idempotency_key))

    @staticmethod
    def submit_jsonl(
        name: str | None, layers: Sequence[int | str] | str | None, idempotency_key: str | None, options: Options = None
    ) -> Call[Job]:
        params = drop_none({"name": name, "layers": layers_param(layers)})
        for key, value in job_options(options).items():
            if key == "regenerate":  # flattened in the query string
                params.update({f"regenerate_{k}": v for k, v in value.items()})
            elif key == "consumers":  # one comma-separated value
                params[key] = ",".join(value)
            else:
                params[key] = value
        return Call(
            "POST",
            "/v1/jobs",
            Job,
            params=params,
            headers={"Content-Type": "application/x-ndjson", **(idempotency_header(idempotency_key) or {})},
        )

    @staticmethod
    def list_jobs(state: str | None, after: str | None, limit: int) -> Call[JobPage]:
        return Call("GET", "/v1/jobs", JobPage, params=drop_none({"state": state, "after": after, "limit": limit}))

    @staticmethod
    def get_job(job: JobRef) -> Call[Job]:
        return Call("GET", jobs_path(job), Job)

    @staticmethod
    def list_samples(job: JobRef, state: str | None, after: str | None, limit: int) -> Call[SamplePage]:
        return Call(
            "GET",
            jobs_path(job, "samples"),
            SamplePage,
            params=drop_none({"state": state, "after": after, "limit": limit}),
        )

    @staticmethod
    def get_sample(job: JobRef, sample_id: str) -> Call[Sample]:
        return Call("GET", jobs_path(job, "samples", sample_id), Sample)

    @staticmethod
    def sample_tensors(job: JobRef, sample_id: str) -> Call[None]:
        return Call("GET", jobs_path(job, "tensors", sample_id))

    @staticmethod
    def cancel(job: JobRef) -> Call[Job]:
        return Call("POST", jobs_path(job, "cancel"), Job)

    @staticmethod
    def retry(job: JobRef) -> Call[Job]:
        return Call("POST", jobs_path(job, "retry"), Job)

    @staticmethod
    def delete(job: JobRef, files: bool) -> Call[None]:
        return Call("DELETE", jobs_path(job), None, params={"delete_files": "true"} if files else None)

    @staticmethod
    def manifest(job: JobRef) -> Call[Manifest]:
        return Call("GET", jobs_path(job, "manifest"), Manifest)

    @staticmethod
    def verify(job: JobRef) -> Call[Report]:
        return Call("POST", jobs_path(job, "verify"), dict)

    @staticmethod
    def list_shards(job: JobRef, after: int = 0, limit: int = 1000, wait: float = 0) -> Call[ShardList]:
        params = {"after": after, "limit": limit, **({"wait": wait} if wait else {})}
        return Call("GET", jobs_path(job, "shards"), ShardList, params=params)

    @staticmethod
    def register_consumer(job: JobRef, name: str) -> Call[Consumer]:
        return Call("POST", jobs_path(job, "consumers"), Consumer, json={"name": name})

    @staticmethod
    def consumers(job: JobRef) -> Call[ConsumerList]:
        return Call("GET", jobs_path(job, "consumers"), ConsumerList)

    @staticmethod
    def consumer(job: JobRef, name: str) -> Call[Consumer]:
        return Call("GET", jobs_path(job, "consumers", name), Consumer)

    @staticmethod
    def ack(job: JobRef, name: str, position: AckIn) -> Call[Consumer]:
        return Call("POST", jobs_path(job, "consumers", name, "acks"), Consumer, json=position.model_dump())

    @staticmethod
    def delete_consumer(job: JobRef, name: str) -> Call[None]:
        return Call("DELETE", jobs_path(job, "consumers", name), None)

    @staticmethod
    def throughput(job: JobRef, points: int) -> Call[Throughput]:
        return Call("GET", jobs_path(job, "throughput"), Throughput, params={"points": points})

    @staticmethod
    def health() -> Call[Health]:
        return Call("GET", "/healthz", Health)

    @staticmethod
    def workers() -> Call[WorkerList]:
        return Call("GET", "/v1/workers", WorkerList)

    @staticmethod
    def token_info() -> Call[TokenInfo]:
        return Call("GET", "/v1/token", TokenInfo)


def file_chunks(f: IO[bytes], size: int = 1 << 16, progress: BytesSent | None = None) -> Iterator[bytes]:
    sent = 0
    while chunk := f.read(size):
        yield chunk
        # called once the chunk has been taken for sending, so the count never runs ahead of the upload
        sent += len(chunk)
        if progress is not None:
            progress(sent)


class JobDownload:
    """A whole job's download as bytes: each shard's progress (passed on to `on_progress`) added to the shards
    already finished, reported to `progress` as (done, total)."""

    def __init__(self, shards: list[ManifestShard], progress: JobBytes | None, on_progress: ShardProgress | None):
        self.total = sum(s.bytes for s in shards)
        self.finished = 0
        self.progress, self.on_progress = progress, on_progress
        self.report(0)

    def shard(self, name: str, done: int, total: int) -> None:
        if self.on_progress is not None:
            self.on_progress(name, done, total)
        self.report(done)

    def shard_done(self, size: int) -> None:
        self.finished += size
        self.report(0)

    def report(self, current: int) -> None:
        if self.progress is not None:
            self.progress(min(self.finished + current, self.total), self.total)


# What `wait()` polls through: the service or its database restarting is not the job failing.
TRANSIENT = (Unavailable, httpx.TransportError)


def long_poll(timeout: httpx.Timeout, wait: float) -> dict[str, Any]:
    """A long poll's request options: its read timeout is the wait itself plus the client's own."""
    if not wait:
        return {}
    return {
        "timeout": httpx.Timeout(
            timeout.connect, read=(timeout.read or 0) + wait, write=timeout.write, pool=timeout.pool
        )
    }


class Feed:
    """follow_shards' bookkeeping, the same for the sync and async clients: where the feed stands, whether it
    is complete, and the pause before asking again after a transient failure (doubling to 10 s)."""

    def __init__(self, after: int):
        self.after = after
        self.complete = False
        self._failures = 0

    def take(self, page: ShardList) -> list[Shard]:
        self._failures = 0
        self.after, self.complete = page.last_seq, page.complete
        return page.data

    def pause(self) -> float:
        self._failures += 1
        return min(10.0, 0.25 * 2**self._failures)


class Poll:
    """wait()'s bookkeeping, the same for the sync and async clients: progress callback, backoff from
    `poll_s` to `max_poll_s`, and the deadline."""

    def __init__(
        self,
        job: JobRef,
        timeout: float | None,
        poll_s: float,
        max_poll_s: float,
        on_progress: Callable[[Job], None] | None,
    ):
        self.job, self.timeout, self.on_progress = job, timeout, on_progress
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.delays = delays(poll_s, max_poll_s)
        self.last: Job | None = None

    def finished(self, current: Job) -> bool:
        previous, self.last = self.last, current
        said = previous.waiting_reason if previous is not None else None
        if current.waiting_reason != said and current.state not in TERMINAL_JOB_STATES:
            # A job that waits looks like a hang from its counts alone: say why, once each time it changes.
            if current.waiting_reason:
                log.warning("job %s waits: %s", current.id, current.waiting_reason)
            else:
                log.info("job %s no longer waits", current.id)
        if self.on_progress is not None:
            self.on_progress(current)
        return current.state in TERMINAL_JOB_STATES

    def pause(self) -> float:
        """Seconds to sleep before the next poll; TimeoutError once the deadline has passed."""
        delay = next(self.delays)
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                what = f"still {self.last.state}" if self.last is not None else "not reachable"
                if self.last is not None and self.last.waiting_reason:
                    what += f", waiting: {self.last.waiting_reason}"
                raise TimeoutError(f"job {job_id(self.job)} is {what} after {self.timeout}s")
            delay = min(delay, left)
        return delay


def delays(first: float, most: float, factor: float = 1.5) -> Iterator[float]:
    """Polling intervals: `first`, growing by `factor` up to `most`."""
    d = max(first, 0.0)
    while True:
        yield d
        d = min(max(d * factor, 0.05), max(most, first))


def tensors_from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load  # imports torch; only when tensors are asked for

    return load(data)


class SSEDecoder:
    """Server-sent events, one line at a time: returns (event, data) when a blank line ends an event."""

    def __init__(self) -> None:
        self.event = ""
        self.data: list[str] = []

    def feed(self, line: str) -> tuple[str, str] | None:
        line = line.rstrip("\r\n")
        if not line:
            if not self.data:
                self.event = ""
                return None
            out = (self.event or "message", "\n".join(self.data))
            self.event, self.data = "", []
            return out
        if line.startswith(":"):
            return None
        key, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if key == "event":
            self.event = value
        elif key == "data":
            self.data.append(value)
        return None


def job_events(decoder: SSEDecoder, line: str) -> Job | None:
    ev = decoder.feed(line)
    if ev is not None and ev[0] == "job":
        return Job.model_validate_json(ev[1])
    return None


def part_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".part")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in file_chunks(f, CHUNK):
            h.update(chunk)
    return h.hexdigest()


def resolve_dest(dest: str | os.PathLike[str] | None, name: str) -> Path:
    if dest is None:
        return Path(name)
    dest = Path(dest)
    return dest / name if dest.is_dir() else dest


@dataclass
class ShardDownload:
    """One shard into `dest`, through `dest.part`: resumes from the part's size with a Range request, hashes
    what is already there, and renames the part into place only when the whole file's sha256 matches."""

    name: str
    dest: Path
    sha256: str | None
    size: int | None
    on_progress: ShardProgress | None = None
    offset: int = 0
    resumed_from: int = 0
    digest: Any = field(default_factory=hashlib.sha256)
    _file: IO[bytes] | None = None
    _total: int | None = None

    def __post_init__(self) -> None:
        self.part = part_path(self.dest)
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        have = self.part.stat().st_size if self.part.exists() else 0
        if self.size is not None and have > self.size:  # not a prefix of this shard
            self.part.unlink()
            have = 0
        if have:
            with open(self.part, "rb") as f:
                for chunk in file_chunks(f, CHUNK):
                    self.digest.update(chunk)
        self.offset = self.resumed_from = have
        self._total = self.size

    def already_done(self) -> bool:
        """True when the destination already holds the shard (checked by sha256)."""
        return (
            self.sha256 is not None
            and self.dest.is_file()
            and (self.size is None or self.dest.stat().st_size == self.size)
            and sha256_of(self.dest) == self.sha256
        )

    def part_complete(self) -> bool:
        return self.size is not None and self.offset == self.size

    def request_headers(self) -> dict[str, str]:
        if not self.offset:
            return {}
        headers = {"Range": f"bytes={self.offset}-"}
        if self.sha256:
            headers["If-Range"] = f'"{self.sha256}"'  # the shard's ETag: another file sends 200, whole
        return headers

    def restart(self) -> None:
        self.part.unlink(missing_ok=True)
        self.digest, self.offset, self.resumed_from = hashlib.sha256(), 0, 0

    def begin(self, resp: httpx.Response) -> None:
        """Open the part for this answer: 206 appends at our offset, 200 starts over."""
        self.sha256 = self.sha256 or resp.headers.get("x-content-sha256")
        if resp.status_code == 206:
            rng = resp.headers.get("content-range", "")
            start, _, total = rng.removeprefix("bytes ").partition("-")
            if not start.isdigit() or int(start) != self.offset:
                raise HsxError(
                    0,
                    {
                        "type": "/problems/unexpected-range",
                        "title": "Unexpected range",
                        "detail": f"{self.name}: Content-Range {rng!r} for a request from byte {self.offset}",
                    },
                )
            total = total.partition("/")[2]
            self._total = int(total) if total.isdigit() else self._total
            mode = "ab"
        else:
            self.restart()
            length = resp.headers.get("content-length")
            self._total = int(length) if length and length.isdigit() else self._total
            mode = "wb"
        self._file = open(self.part, mode)  # noqa: SIM115 - held across write() calls, closed by the download
        self.progress()

    def write(self, chunk: bytes) -> None:
        if self._file is None:
            raise RuntimeError(f"{self.name}: a chunk arrived before the response was opened")
        self._file.write(chunk)
        self.digest.update(chunk)
        self.offset += len(chunk)
        self.progress()

    def progress(self) -> None:
        if self.on_progress is not None:
            self.on_progress(self.name, self.offset, self._total or self.offset)

    def close(self) -> None:
        """Keep what arrived: the next call resumes from it."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def finish(self) -> Path:
        self.close()
        got = self.digest.hexdigest()
        if self.sha256 is not None and got != self.sha256:
            self.part.unlink(missing_ok=True)  # a bad part never resumes
            raise ChecksumMismatch(self.name, self.sha256, got)
        os.replace(self.part, self.dest)
        fsync_path(self.dest.parent)
        self.progress()
        return self.dest


def write_atomic(path: Path, data: bytes) -> Path:
    with atomic_file(path) as f:
        f.write(data)
    return path


def check_shard_name(name: str) -> None:
    """Shard names come from the server; refuse any that is not a plain file name."""
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise HsxError(
            0,
            {
                "type": "/problems/unsafe-name",
                "title": "Unsafe shard name",
                "detail": f"refusing to write a shard named {name!r}",
            },
        )


Options = JobOptions | Mapping[str, Any] | None


def job_options(options: Options) -> dict[str, Any]:
    """A job's options as the request carries them: checked here first (JobOptions), only those that
    differ from the defaults."""
    if options is None:
        return {}
    checked = options if isinstance(options, JobOptions) else JobOptions.model_validate(dict(options))
    return checked.model_dump(mode="json", exclude_defaults=True)

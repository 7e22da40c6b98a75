"""The shard flusher: writes shards from staged dumps in the background, while the request loop
sends the next requests.

It counts the bytes each job has staged and waiting. A job's staged samples go to a shard once
they fill one (shard_max_bytes), once the oldest has waited shard_max_wait_s, or once no queued
sample is left to join them; staged bytes are bounded, so requests wait when the disk is slower
than the model server. A full output disk pauses extraction until a shard can be written again. A
sample whose values turn out NaN or Inf fails its attempt; the others get a shard without it.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from hsx.backends.dumps import DumpRejected, load_staged
from hsx.config import Settings
from hsx.db import repository as repo
from hsx.db.models import JobRow, SampleRow
from hsx.extraction.database import Database
from hsx.extraction.disk import DISK_RETRY_S, DiskPause, output_blocked
from hsx.extraction.finishing import JobFinisher
from hsx.extraction.lease import Lease
from hsx.extraction.metrics import WriterMetrics
from hsx.extraction.output_root import shared_output_root
from hsx.manifest import job_dir
from hsx.states import TERMINAL_JOB_STATES
from hsx.storage.shards import NonFiniteSamples, ShardSample, shard_name, write_shard
from sqlalchemy.orm import Session

log = logging.getLogger("hsx.writer")

FLUSH_POLL_S = 0.4

# A staged sample and what of it goes into a shard.
Piece = tuple[SampleRow, ShardSample]


@dataclass
class _Pending:
    """This writer's staged samples of one job that wait for their shard."""

    bytes: int = 0
    since: float = field(default_factory=time.monotonic)


def _staged_dir(x: SampleRow) -> Path:
    # Every staged row records where its dump waits: the path and the state change together.
    assert x.staged_path is not None
    return Path(x.staged_path)


class ShardFlusher:
    def __init__(
        self,
        settings: Settings,
        identity: str,
        db: Database,
        metrics: WriterMetrics,
        finisher: JobFinisher,
        pause: DiskPause,
        lease: Lease,
    ):
        self.settings = settings
        self.identity = identity
        self.lease = lease
        self.db = db
        self.metrics = metrics
        self.finisher = finisher
        self.pause = pause
        self.max_staged_bytes = max(2 * settings.shard_max_bytes, 64 * 1024 * 1024)
        self._pending: dict[str, _Pending] = defaultdict(_Pending)
        # A shard number reserved for a write that failed, per job: the job's next shard takes it,
        # so that failed writes (a full disk tried again and again) leave no gaps in the numbering.
        self._unused_number: dict[str, int] = {}
        # Guards _pending; the condition wakes request loops waiting for staging room.
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._wake = threading.Event()

    # --- what the request loop tells the flusher ---------------------------------------------

    def adopt(self, job_id: str) -> None:
        """Samples of this job were staged before a restart: they join its next shard."""
        with self._lock:
            self._pending.setdefault(job_id, _Pending())

    def staged(self, job_id: str, nbytes: int) -> None:
        """A sample of the job was staged (and committed as such)."""
        with self._lock:
            pending = self._pending[job_id]
            pending.bytes += nbytes
            if pending.bytes >= self.settings.shard_max_bytes:
                self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def wait_for_room(self) -> bool:
        """Bound what waits in staging: when the disk is slower than the server, requests wait."""
        with self._room:
            if self._staged_bytes() < self.max_staged_bytes:
                return True
            self._wake.set()
            self._room.wait(timeout=1.0)
            return self._staged_bytes() < self.max_staged_bytes

    def settle(self, job_id: str) -> None:
        """After a sample's outcome: flush this writer's staged samples once no queued sample can
        join them, then finish the job if that was the last of it."""
        job = self._job(job_id)
        drained = job is not None and job.n_queued == 0
        with self._lock:
            has_pending = job_id in self._pending
        if drained and has_pending:
            self._wake.set()
        elif not has_pending:
            self.finisher.finish(job_id)

    def stop(self) -> None:
        """Release whoever waits on the flusher: its own turn and request loops waiting for room."""
        self._wake.set()
        with self._room:
            self._room.notify_all()

    # --- the flusher's thread -----------------------------------------------------------------

    def step(self) -> None:
        """One turn: write shards that are due and finish the jobs they complete, fenced by the
        writer's lease as the turn starts."""
        self._wake.wait(FLUSH_POLL_S)
        self._wake.clear()
        with self.db.fenced(self.lease.epoch):
            self.finisher.retry_due()
            self._flush_due()

    def _staged_bytes(self) -> int:
        return sum(p.bytes for p in self._pending.values())

    def _job(self, job_id: str) -> JobRow | None:
        return self.db.run(lambda s: repo.get_job(s, job_id))

    def _flush_due(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = list(self._pending.items())
        for job_id, pending in due:
            job = self._job(job_id)
            if job is None or job.state in TERMINAL_JOB_STATES:
                self._unused_number.pop(job_id, None)
            # Drained: no queued sample is left to fill a shard; only running ones, which get the next.
            drained = job is None or job.n_queued == 0
            aged = now - pending.since >= self.settings.shard_max_wait_s
            if drained or aged or pending.bytes >= self.settings.shard_max_bytes:
                if self._flush(job_id, complete=drained or aged):
                    self.finisher.finish(job_id)

    def _flush(self, job_id: str, *, complete: bool) -> bool:
        """Write this writer's staged samples of a job as shards of at most shard_max_bytes (a
        sample larger than that gets a shard of its own). The last, smaller shard is written only
        when `complete`; otherwise its samples keep waiting. On failure everything stays staged and
        is tried again: soon when the disk was full, else after shard_max_wait_s."""
        with self._lock:
            pending = self._pending.pop(job_id, None) or _Pending()
        try:
            left = self._write_staged(job_id, complete)
        except Exception as exc:
            blocked = output_blocked(exc)
            if blocked:
                self.pause.reason = f"{blocked}, extraction paused until shards can be written: {exc}"
                pending.since = time.monotonic() - self.settings.shard_max_wait_s + DISK_RETRY_S
            else:
                log.exception("job %s: writing a shard failed; its staged samples wait for the next try", job_id)
                pending.since = time.monotonic()
            left = pending.bytes
        else:
            self.pause.reason = None
        if left:
            with self._lock:
                self._pending[job_id].bytes += left
                self._pending[job_id].since = pending.since
        with self._room:
            self._room.notify_all()
        return not left

    def _write_staged(self, job_id: str, complete: bool) -> int:
        """Write full shards (and the last one when `complete`); return the bytes left staged."""
        staged = self.db.run(lambda s: repo.staged_samples(s, self.identity, job_id))
        job = self._job(job_id)
        if not staged or job is None:
            return 0
        chunks: list[list[Piece]] = [[]]
        size = 0
        lost: list[tuple[int, str]] = []
        for x in staged:
            try:
                dump = load_staged(_staged_dir(x))
            except (DumpRejected, OSError) as exc:
                lost.append((x.pk, str(exc)))
                continue
            if chunks[-1] and size + dump.nbytes > self.settings.shard_max_bytes:
                chunks.append([])
                size = 0
            ids = np.frombuffer(x.input_ids, dtype="<i4").astype(np.int64)
            mask = (
                np.frombuffer(x.loss_mask, dtype=np.uint8)
                if x.loss_mask is not None
                else np.ones(len(ids), dtype=np.uint8)
            ).astype(np.int64)
            chunks[-1].append((x, ShardSample(x.sample_id, ids, mask, dump.layers)))
            size += dump.nbytes
        if lost:

            def requeue_lost(s: Session) -> None:
                for pk, why in lost:
                    repo.requeue_staged(s, job_id, [pk], f"staged dump unreadable: {why}")

            self.db.run(requeue_lost)
        left = 0
        if chunks[-1] and not complete and size < self.settings.shard_max_bytes:
            chunks.pop()
            left = size
        for chunk in chunks:
            if chunk:
                self._write_shard(job, chunk)
        return left

    def _write_shard(self, job: JobRow, pieces: list[Piece]) -> None:
        info, job_id = job.model_info, job.id
        # The job's model is recorded in the transaction that stages its first sample.
        assert info is not None
        root = self.settings.output_root
        self.db.run(lambda s: shared_output_root(s, root))
        number = self._unused_number.pop(job_id, None)
        if number is None:
            number = self.db.run(lambda s: repo.reserve_shard_number(s, job_id))
        out = job_dir(root, job_id) / shard_name(number)
        # Until a shard is recorded under the number, the job's next shard may take it: a write that
        # failed (a full disk, tried again and again) leaves no gap in the numbering. A file it left
        # under that name is unrecorded and is replaced whole.
        try:
            shard = write_shard(out, [p for _, p in pieces], info["layers"], info["dtype"], info["hidden_size"])
        except NonFiniteSamples as exc:
            self._unused_number[job_id] = number
            # Only those samples failed: their attempts say why, the others get a shard without them.
            self._reject(job_id, [(x, exc.reasons[p.sample_id]) for x, p in pieces if p.sample_id in exc.reasons])
            rest = [(x, p) for x, p in pieces if p.sample_id not in exc.reasons]
            if rest:
                self._write_shard(job, rest)
            return
        except BaseException:
            self._unused_number[job_id] = number
            raise
        placed = [(x.pk, off, p.num_tokens) for (x, p), off in zip(pieces, shard.offsets)]
        try:
            self.db.run(
                lambda s: repo.commit_shard(
                    s, job_id, name=shard.name, nbytes=shard.bytes, sha256=shard.sha256, placed=placed
                )
            )
        except repo.LeaseLost:
            out.unlink(missing_ok=True)  # its samples went back to the queue: no manifest may name it
            raise
        for x, _ in pieces:
            shutil.rmtree(_staged_dir(x), ignore_errors=True)
        log.info(
            "job %s: wrote %s (%d samples, %d tokens, %d bytes)",
            job_id,
            shard.name,
            shard.num_samples,
            shard.num_tokens,
            shard.bytes,
        )

    def _reject(self, job_id: str, rejected: list[tuple[SampleRow, str]]) -> None:
        for x, why in rejected:
            reason = f"non_finite: {why}"
            outcome = self._reject_staged(job_id, x.pk, reason)
            shutil.rmtree(_staged_dir(x), ignore_errors=True)
            self.metrics.attempt("rejected", reason)
            log.info("sample %s/%s: %s (%s)", job_id, x.sample_id, reason, outcome)

    def _reject_staged(self, job_id: str, pk: int, reason: str) -> str:
        return self.db.run(
            lambda s: repo.reject_staged(s, job_id, pk, reason=reason, max_attempts=self.settings.max_attempts)
        )

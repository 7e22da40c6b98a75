"""The shard flushers: several threads write shards from staged dumps in the background, while the
request loop sends the next requests.

Each staged sample waits in memory (staged.StagedSamples) until a flusher takes it into a batch; a
batch is one shard, written and hashed (sha256) by the flusher that took it while the other flushers
write other batches of the same or other jobs. Deciding what is due is done by one flusher at a time
(so two never each cut a small shard of the same samples); writing is done by all at once.

When a job's staged samples go to a shard:
- full: as soon as they fill one (shard_max_bytes; the oldest first, as many as fit);
- the job's end: once no queued sample is left and none of this writer's samples of the job is still
  running, the rest goes to the job's last, smaller shard. While the requests still in flight run,
  the staged samples wait for them (unless they fill a shard), so a job ends with one small shard per
  writer, not with a small shard for each of its last requests;
- the time bound: a sample waits at most shard_max_wait_s while the job still has queued samples. A
  shard is worth waiting for only while samples arrive quickly; when the request loop is slower than
  the disk, a full shard would keep the disk idle for minutes (at a job's start too) while staged
  dumps hold memory in the dump root's file system, so after that bound what is staged is written
  as a smaller shard. At hundreds of MB/s a 256 MiB shard fills well within the default (10 s), so
  it cuts only the shards of slow extractions, at most one smaller shard per job and writer every
  10 s.

Staged bytes nobody has taken yet are bounded (max_staged_bytes), so requests wait when the disk is
slower than the model server; each flusher holds at most one more shard's worth while writing it. A
full output disk pauses extraction until a shard can be written again. A sample whose values turn
out NaN or Inf fails its attempt; the others of its batch wait again for the next shard.

Every flusher's writes are fenced by the writer's lease, as the request loop's are. A shard's samples
are recorded in the one transaction that records the shard (repository.commit_shard); staged samples
not in a recorded shard are found again at the next start (Writer.start_thread). Shard numbers stay
gap-free per job, whichever flusher writes which shard: a shard takes its number only once it is on
disk whole (a write that fails takes none), and the number of one that could not be recorded (the
lease was lost) goes to the job's next shard here. The job is finished (manifest, terminal state) by
whichever flusher leaves nothing of it waiting or being written, after its last shard.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from sqlalchemy.orm import Session

from hsx.backends.dumps import DumpRejected, load_staged
from hsx.config import Settings
from hsx.db import repository as repo
from hsx.db.models import JobRow, SampleRow
from hsx.extraction.database import Database
from hsx.extraction.disk import DISK_RETRY_S, DiskPause, output_blocked
from hsx.extraction.encoders import encoder_pool
from hsx.extraction.finishing import JobFinisher
from hsx.extraction.lease import Lease
from hsx.extraction.metrics import WriterMetrics
from hsx.extraction.output_root import shared_output_root
from hsx.extraction.staged import Batch, Staged, StagedSamples
from hsx.manifest import job_dir
from hsx.states import TERMINAL_JOB_STATES
from hsx.storage.atomic import fsync_path
from hsx.storage.encoding import encoding_of
from hsx.storage.shards import NonFiniteSamples, ShardSample, shard_name, write_shard

log = logging.getLogger("hsx.writer")

FLUSH_POLL_S = 0.4

# A staged sample and what of it goes into a shard.
Piece = tuple[SampleRow, ShardSample]


def _staged_dir(x: SampleRow) -> Path:
    # Every staged row records where its dump waits: the path and the state change together.
    assert x.staged_path is not None
    return Path(x.staged_path)


class ShardFlusher:
    def __init__(
        self,
        *,
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
        # Guards _staged, _unused_numbers and _changes; the conditions wake flushers with work and
        # request loops waiting for staging room.
        self._lock = threading.Lock()
        self._staged = StagedSamples(settings.shard_max_bytes)
        self._work = threading.Condition(self._lock)
        self._room = threading.Condition(self._lock)
        self._changes = 0  # counts what may make a shard due; an idle flusher sleeps only while it is unchanged
        # Shard numbers taken for shards that were then not recorded (the lease was lost), per job: the
        # job's next shards here take them, so that the numbering has no gaps.
        self._unused_numbers: dict[str, list[int]] = defaultdict(list)
        # One flusher at a time decides what is due and takes it; the others write meanwhile.
        self._cutting = threading.Lock()
        self._looked = (-1, 0.0)  # (changes, time) when the database was last asked about partial shards

    # --- what the request loop tells the flusher ---------------------------------------------

    def adopt(self, rows: list[SampleRow]) -> None:
        """Samples staged before a restart: they join their jobs' next shards."""
        now = time.monotonic()
        for x in rows:
            try:
                nbytes = load_staged(_staged_dir(x)).nbytes
            except (DumpRejected, OSError):
                nbytes = 0  # unreadable: writing its shard requeues it
            with self._lock:
                self._staged.add(x.job_id, x.pk, Staged(nbytes, now))
        self.wake()

    def staged(self, job_id: str, pk: int, nbytes: int) -> None:
        """A sample of the job was staged (and committed as such)."""
        with self._lock:
            if self._staged.add(job_id, pk, Staged(nbytes, time.monotonic())) >= self.settings.shard_max_bytes:
                self._changed()

    def wake(self) -> None:
        """Something may have made a shard due (a job with no queued sample left): flushers look now."""
        with self._lock:
            self._changed()

    def wait_for_room(self) -> bool:
        """Bound what waits in staging: when the disk is slower than the server, requests wait."""
        with self._room:
            if self._staged.waiting_bytes < self.max_staged_bytes:
                return True
            self._changed()
            self._room.wait(timeout=1.0)
            return self._staged.waiting_bytes < self.max_staged_bytes

    def settle(self, job_id: str, queued: int | None = None) -> None:
        """After a sample's outcome: once no queued sample is left, the job's last shard may be due;
        a job with nothing here waiting or being written is finished if that was the last of it
        (otherwise the flusher that writes its last shard finishes it). `queued`: the job's queued
        samples as the outcome was recorded, when known (else they are read)."""
        if queued is None:
            job = self._job(job_id)
            queued = job.n_queued if job is not None else 0
        with self._lock:
            held = self._staged.holds(job_id)
            if held and queued == 0:
                self._changed()
        if not held:
            self._finish(job_id)

    def stop(self) -> None:
        """Release whoever waits on the flushers: their own turns and request loops waiting for room."""
        with self._lock:
            self._changed()
            self._room.notify_all()

    # --- the flushers' threads ----------------------------------------------------------------

    def step(self) -> None:
        """One flusher's turn: take a batch that is due and write it as a shard (finishing the job if
        that was its last), else wait a little for one. Fenced by the writer's lease as the turn starts."""
        with self._lock:
            seen = self._changes
        with self.db.fenced(self.lease.epoch):
            batch = self._next_batch()
            if batch is not None:
                self._write(batch)
                return
        with self._work:
            if self._changes == seen:
                self._work.wait(FLUSH_POLL_S)

    def _changed(self) -> None:
        # Called with the lock held.
        self._changes += 1
        self._work.notify_all()

    def _job(self, job_id: str) -> JobRow | None:
        return self.db.run(lambda s: repo.get_job(s, job_id))

    def _next_batch(self) -> Batch | None:
        with self._cutting:
            self.finisher.retry_due()
            now = time.monotonic()
            with self._lock:
                waiting = self._staged.waiting(now)
                full = [w for w in waiting if w.nbytes >= self.settings.shard_max_bytes]
                if not full and waiting and self._staged.waiting_bytes >= self.max_staged_bytes:
                    full = waiting[:1]  # staging is full of jobs that each fill less than a shard
                if full:
                    return self._take(full[0].job_id)
                changes = self._changes
            # Partial shards depend on the database (queued and running samples): asked when something
            # changed, else once per poll, however many flushers are idle.
            if not waiting or (changes == self._looked[0] and now - self._looked[1] < FLUSH_POLL_S):
                return None
            self._looked = (changes, now)
            for w in waiting:
                if self._partial_due(w.job_id, aged=now - w.oldest >= self.settings.shard_max_wait_s):
                    with self._lock:
                        return self._take(w.job_id)
            return None

    def _take(self, job_id: str) -> Batch | None:
        # Called with the lock and _cutting held. What is left may be due as well: the next turn asks.
        self._looked = (-1, 0.0)
        batch = self._staged.take(job_id)
        self._room.notify_all()  # what a flusher took no longer counts against staging room
        return batch

    def _partial_due(self, job_id: str, *, aged: bool) -> bool:
        """Whether the job's waiting samples, less than a shard, are written now."""
        job = self._job(job_id)
        if job is None or job.state in TERMINAL_JOB_STATES:
            return True  # nothing more can join them; writing sorts out what is still this writer's
        if job.n_queued:
            return aged  # samples still to come may fill the shard
        # No queued sample is left: only this writer's requests in flight can still join the job's
        # last shard here, and they end soon (staged or failed).
        return self.db.run(lambda s: repo.running_samples(s, self.identity, job_id)) == 0

    def _write(self, batch: Batch) -> None:
        """Write `batch` as a shard. On failure its samples wait again: soon when the disk was full
        or the lease was lost (registering again settles which stay this writer's), else after
        shard_max_wait_s."""
        job_id = batch.job_id
        back: list[int] = []
        not_before = 0.0
        try:
            back = self._write_batch(batch)
        except Exception as exc:
            back = list(batch.samples)
            if isinstance(exc, repo.LeaseLost):
                raise
            blocked = output_blocked(exc)
            if blocked:
                self.pause.reason = f"{blocked}, extraction paused until shards can be written: {exc}"
                not_before = time.monotonic() + DISK_RETRY_S
            else:
                log.exception("job %s: writing a shard failed; its staged samples wait for the next try", job_id)
                not_before = time.monotonic() + self.settings.shard_max_wait_s
        else:
            self.pause.reason = None
        finally:
            with self._lock:
                idle = self._staged.done(batch, back, not_before)
                if back:
                    self._changed()
                self._room.notify_all()
        if idle:
            self._finish(job_id)

    def _finish(self, job_id: str) -> None:
        if self.finisher.finish(job_id) is not None:
            with self._lock:
                self._unused_numbers.pop(job_id, None)

    def _write_batch(self, batch: Batch) -> list[int]:
        """Write the batch's samples that are still this writer's staged ones as one shard; return
        the samples that wait again (those left out with a sample that failed)."""
        job_id = batch.job_id
        staged = self.db.run(lambda s: repo.staged_samples(s, self.identity, job_id, pks=list(batch.samples)))
        job = self._job(job_id)
        if not staged or job is None:
            return []
        pieces: list[Piece] = []
        lost: list[tuple[int, str]] = []
        for x in staged:
            try:
                dump = load_staged(_staged_dir(x))
            except (DumpRejected, OSError) as exc:
                lost.append((x.pk, str(exc)))
                continue
            ids = np.frombuffer(x.input_ids, dtype="<i4").astype(np.int64)
            mask = (
                np.frombuffer(x.loss_mask, dtype=np.uint8)
                if x.loss_mask is not None
                else np.ones(len(ids), dtype=np.uint8)
            ).astype(np.int64)
            pieces.append((x, ShardSample(x.sample_id, ids, mask, dump.layers)))
        if lost:

            def requeue_lost(s: Session) -> None:
                for pk, why in lost:
                    repo.requeue_staged(s, job_id, [pk], f"staged dump unreadable: {why}")

            self.db.run(requeue_lost)
        return self._write_shard(job, pieces) if pieces else []

    def _take_number(self, job_id: str) -> int:
        with self._lock:
            unused = self._unused_numbers.get(job_id)
            if unused:
                number = min(unused)
                unused.remove(number)
                return number
        return self.db.run(lambda s: repo.reserve_shard_number(s, job_id))

    def _give_back_number(self, job_id: str, number: int) -> None:
        with self._lock:
            self._unused_numbers[job_id].append(number)

    def _write_shard(self, job: JobRow, pieces: list[Piece]) -> list[int]:
        """Write the pieces as the job's next shard; return the samples that wait again (those
        written with a sample that turned out NaN or Inf)."""
        info, job_id = job.model_info, job.id
        # The job's model is recorded in the transaction that stages its first sample.
        assert info is not None
        root = self.settings.output_root
        self.db.run(lambda s: shared_output_root(s, root))
        folder = job_dir(root, job_id)
        # Written under a name of its own first and numbered only once it is on disk whole, so that
        # writes that fail (a full disk, tried again and again by several flushers) take no number.
        # Whatever a crash leaves under such a name is removed when the job finishes.
        unnumbered = folder / f".unnumbered-{secrets.token_hex(8)}.tmp-{os.getpid()}"
        started = time.monotonic()
        encoding = (job.options or {}).get("encoding", "raw")
        try:
            shard = write_shard(
                unnumbered,
                [p for _, p in pieces],
                info["layers"],
                info["dtype"],
                info["hidden_size"],
                # the job's encoding (JobOptions.encoding), off the request loops' path: this flusher reads
                # and checks the blocks, the encoding threads encode them
                encoding=encoding,
                encoders=encoder_pool() if encoding_of(encoding).encoded else None,
            )
        except NonFiniteSamples as exc:
            # Only those samples failed: their attempts say why, the others wait for the next shard.
            self._reject(job_id, [(x, exc.reasons[p.sample_id]) for x, p in pieces if p.sample_id in exc.reasons])
            return [x.pk for x, p in pieces if p.sample_id not in exc.reasons]
        try:
            number = self._take_number(job_id)
            out = folder / shard_name(number)
            try:
                os.replace(unnumbered, out)
                fsync_path(folder)
            except BaseException:
                self._give_back_number(job_id, number)
                raise
        finally:
            unnumbered.unlink(missing_ok=True)
        placed = [(x.pk, off, p.num_tokens) for (x, p), off in zip(pieces, shard.offsets)]
        layer_stats = (
            None if shard.layer_stats is None else {str(i): st.to_json() for i, st in shard.layer_stats.items()}
        )
        try:
            self.db.run(
                lambda s: repo.commit_shard(
                    s,
                    job_id,
                    name=out.name,
                    nbytes=shard.bytes,
                    sha256=shard.sha256,
                    placed=placed,
                    layer_stats=layer_stats,
                )
            )
        except repo.LeaseLost:
            # Nothing was recorded: its samples went back to the queue, no manifest may name it, and
            # the job's next shard here takes its number.
            out.unlink(missing_ok=True)
            self._give_back_number(job_id, number)
            raise
        self.metrics.shard_written(time.monotonic() - started, shard.bytes)
        for x, _ in pieces:
            shutil.rmtree(_staged_dir(x), ignore_errors=True)
        log.info(
            "job %s: wrote %s (%d samples, %d tokens, %d bytes)",
            job_id,
            out.name,
            shard.num_samples,
            shard.num_tokens,
            shard.bytes,
        )
        return []

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

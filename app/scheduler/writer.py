"""The single writer for one dump root: claim a sample, extract it, stage it, write shards.

Only one writer may use a dump root: the file-system lock (DumpRoot.acquire) stops a second
process here, and the database allows one running sample per writer identity.

The GPU should never wait on us. The request loop only sends, finds, validates and stages: a
validated dump is renamed out of the root (the root is clear again at once) and a background
flusher writes shards from the staged dumps while the next request runs. In rid mode several
slots keep requests in flight at once; each slot claims under its own identity ("<writer>#<n>"),
so the database still holds one running sample per identity. Staged bytes are bounded.

Whatever breaks, a sample ends stored with its own tensors or failed with a reason:
- the model server down or restarting: the attempt is given back unspent, the writer backs off
  and waits for /health before it trusts the server again, re-reading its settings;
- the database down: every state change after an extraction is retried until it lands (the
  staged dump waits on disk meanwhile), and a crash in between is recovered at the next start;
- the output disk full: no new sample is claimed; staged samples wait and the shard is
  written again once there is room.
"""

from __future__ import annotations

import errno
import logging
import shutil
import socket
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, TypeVar

import numpy as np
from hsx.backends.dumps import DumpRejected, DumpRoot, load_staged
from hsx.backends.extract import Expectation, Extractor
from hsx.backends.sglang import BackendRejected, BackendUnavailable, SGLangClient
from hsx.config import Settings
from hsx.db import repository as repo
from hsx.manifest import job_dir
from hsx.manifests import finish_job
from hsx.scheduler.metrics import WriterMetrics
from hsx.scheduler.server_check import dump_breaking_settings
from hsx.storage.shards import NonFiniteSamples, ShardSample, shard_name, write_shard
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger("hsx.writer")

T = TypeVar("T")
IDLE_POLL_S = 0.2
MAX_BACKOFF_S = 10.0
SERVER_RECHECK_S = 60.0
HEARTBEAT_S = 5.0
DISK_RETRY_S = 2.0
# rid mode: completed dumps nobody waits for (warm-up, health checks, other clients) are swept.
SWEEP_EVERY_S = 60.0
SWEEP_AGE_S = 120.0


@dataclass
class WriterStatus:
    state: str = "starting"  # starting | ready | waiting | refusing | stopped
    reason: str | None = None
    since: float = field(default_factory=time.time)
    server: dict | None = None

    def set(self, state: str, reason: str | None = None) -> bool:
        """Returns whether anything changed."""
        if (state, reason) == (self.state, self.reason):
            return False
        self.state, self.reason, self.since = state, reason, time.time()
        if reason:
            log.warning("writer %s: %s", state, reason)
        return True


@dataclass
class _Pending:
    """This writer's staged samples of one job that wait for their shard."""

    bytes: int = 0
    since: float = field(default_factory=time.monotonic)


def writer_identity(dump_root: Path) -> str:
    return f"{socket.gethostname()}:{Path(dump_root).resolve()}"


def _disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


class Writer:
    def __init__(self, settings: Settings, sessions: sessionmaker[Session]):
        self.settings = settings
        self.sessions = sessions
        self.identity = writer_identity(settings.dump_root)
        self.root = DumpRoot(settings.dump_root)
        self.staging = settings.resolved_staging_dir()
        self.client = SGLangClient(settings.backend_url, settings.request_timeout_s)
        self.status = WriterStatus()
        self.metrics = WriterMetrics()
        self.extractor: Extractor | None = None
        self._model_info: dict = {}
        self._server_layers: list[int] | None = None
        self._boot_id: str | None = None
        self._outage = False
        self._checked_at = 0.0
        self._backoff = 0.5
        self._paused: str | None = None
        self._pending: dict[str, _Pending] = defaultdict(_Pending)
        self._finish_due: set[str] = set()
        # Guards _pending and _finish_due; the condition wakes slots waiting for staging room.
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)
        self._server_lock = threading.Lock()
        self._flush_wake = threading.Event()
        self._work = threading.Event()  # set when a job may have new queued samples
        self.slots = max(1, settings.max_in_flight)
        self.max_staged_bytes = max(2 * settings.shard_max_bytes, 64 * 1024 * 1024)
        self._started_at = repo.utcnow()
        self._reported_at = 0.0
        self._swept_at = 0.0
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # --- life cycle -------------------------------------------------------------------------

    def acquire(self) -> None:
        """Lock the dump root; raises DumpRootBusy when another process holds it."""
        self.root.acquire()
        self.staging.mkdir(parents=True, exist_ok=True)

    def start_thread(self) -> None:
        """Recover what a crash left behind, then run the loop in the background."""
        requeued, kept = self._db(
            lambda s: repo.recover_writer(s, self.identity, lambda p: (Path(p) / "done").exists())
        )
        # Samples staged before a restart join the next shard of their job.
        for job_id in {x.job_id for x in self._db(lambda s: repo.staged_samples(s, self.identity))}:
            self._pending[job_id]
        if requeued or kept:
            log.info("recovered: %d samples requeued, %d staged samples kept", requeued, kept)
        self._threads = [
            threading.Thread(target=self._run, args=(self.step, i), name=f"hsx-writer-{i}", daemon=True)
            for i in range(self.slots)
        ]
        self._threads.append(
            threading.Thread(target=self._run, args=(self.flush_step, 0), name="hsx-flusher", daemon=True)
        )
        for t in self._threads:
            t.start()

    def notify_work(self) -> None:
        """Queued samples may have appeared (a job created or retried in this process): idle
        request loops look now rather than at their next poll. Other processes' jobs are found
        by the poll."""
        self._work.set()

    def stop(self) -> None:
        self._stop.set()
        self._work.set()
        self._flush_wake.set()
        with self._room:
            self._room.notify_all()
        for t in self._threads:
            t.join(timeout=self.settings.request_timeout_s + 10)
        self.status.set("stopped")
        try:
            self._report(force=True)
        except Exception:  # stopping must not fail because the database is gone
            log.warning("could not record the writer's stop")
        self.client.close()
        self.root.release()

    def _run(self, step: Callable[[int], bool], slot: int) -> None:
        while not self._stop.is_set():
            try:
                step(slot)
            except Exception:  # the loop must outlive any one failure; the sample's state says what happened
                log.exception("writer step failed")
                self._stop.wait(1.0)

    def slot_identity(self, slot: int) -> str:
        return self.identity if slot == 0 else f"{self.identity}#{slot}"

    # --- database -----------------------------------------------------------------------------

    def _db(self, fn: Callable[[Session], T]) -> T:
        """Run fn in a transaction, retrying while the database is unreachable or locked."""
        delay = 0.5
        while True:
            try:
                with self.sessions.begin() as s:
                    result = fn(s)
                if self.status.state == "waiting" and (self.status.reason or "").startswith("database"):
                    self.status.set("ready" if self.extractor else "starting")
                return result
            except (OperationalError, InterfaceError) as exc:
                if self._stop.is_set():
                    raise
                self.status.set("waiting", f"database unavailable: {type(exc.orig).__name__}: {exc.orig}")
                self._stop.wait(delay)
                delay = min(delay * 2, MAX_BACKOFF_S)

    def _report(self, force: bool = False) -> None:
        if not force and time.monotonic() - self._reported_at < HEARTBEAT_S:
            return
        self._reported_at = time.monotonic()
        self._db(
            lambda s: repo.report_writer(
                s,
                self.identity,
                state=self.status.state,
                reason=self.status.reason,
                server=self.status.server,
                started_at=self._started_at,
            )
        )

    def _set_status(self, state: str, reason: str | None = None) -> None:
        if self.status.set(state, reason):
            self._report(force=True)

    # --- one step -----------------------------------------------------------------------------

    def step(self, slot: int = 0) -> bool:
        """One request loop turn: process at most one sample; returns whether one was processed."""
        if slot == 0:
            self._report()
        if not self._ensure_server():
            self._stop.wait(self._backoff)
            self._backoff = min(self._backoff * 2, MAX_BACKOFF_S)
            return False
        if slot > 0 and self.extractor.name_by != "rid":
            self._stop.wait(1.0)  # counter naming needs the root to itself: one request at a time
            return False
        if self._paused:
            self._set_status("waiting", self._paused)
            self._stop.wait(DISK_RETRY_S)
            return False
        if not self._wait_for_room():
            return False
        self._set_status("ready")
        claimed = self._db(lambda s: repo.claim_next(s, self.slot_identity(slot)))
        if claimed is None:
            if slot == 0:
                self._sweep()
            if self._work.wait(IDLE_POLL_S):
                self._work.clear()
            return False
        if claimed.queued_left == 0:
            # Nothing left to claim: what is staged can go to its shard while the last requests
            # run, so the job ends with only their samples left to write.
            self._flush_wake.set()
        if claimed.job_layers is not None and self._server_layers not in (None, claimed.job_layers):
            self._refuse_job(claimed)
        else:
            self._process(claimed)
        self._settle_job(claimed.job_id)
        return True

    def flush_step(self, _slot: int = 0) -> None:
        """The flusher's turn: write shards that are due and finish the jobs they complete."""
        self._flush_wake.wait(IDLE_POLL_S * 2)
        self._flush_wake.clear()
        self._retry_finishes()
        self._flush_due()

    def _staged_bytes(self) -> int:
        return sum(p.bytes for p in self._pending.values())

    def _wait_for_room(self) -> bool:
        """Bound what waits in staging: when the disk is slower than the server, requests wait."""
        with self._room:
            if self._staged_bytes() < self.max_staged_bytes:
                return True
            self._flush_wake.set()
            self._room.wait(timeout=1.0)
            return self._staged_bytes() < self.max_staged_bytes

    def _ensure_server(self) -> bool:
        if self.extractor is not None and time.monotonic() - self._checked_at < SERVER_RECHECK_S:
            return True
        with self._server_lock:
            if self.extractor is not None and time.monotonic() - self._checked_at < SERVER_RECHECK_S:
                return True
            return self._check_server()

    def _check_server(self) -> bool:
        try:
            if self._outage:
                # A restarting server answers some endpoints before it is ready; /health says when.
                self.client.health()
            model_info = self.client.model_info()
            server_info = self.client.server_info()
        except (BackendUnavailable, BackendRejected) as exc:
            self.extractor = None
            self._outage = True
            self._set_status("waiting", f"model server not ready: {exc}")
            return False
        problems = dump_breaking_settings(server_info)
        if problems:
            self.extractor = None
            self._set_status("refusing", "; ".join(problems))
            return False
        dump = server_info.get("hs_dump") or {}
        name_by = self.settings.name_by if self.settings.name_by != "auto" else dump.get("name_by", "counter")
        boot_id = dump.get("boot_id")
        if self._boot_id and boot_id and boot_id != self._boot_id:
            log.warning("model server restarted (boot id %s -> %s); settings re-read", self._boot_id, boot_id)
        self._boot_id = boot_id
        self._server_layers = [int(i) for i in dump["layers"]] if dump.get("layers") else None
        self._model_info = {
            "model_path": model_info.get("model_path"),
            "num_hidden_layers": model_info.get("num_hidden_layers"),
            "vocab_size": model_info.get("vocab_size"),
        }
        self.extractor = Extractor(
            self.client, self.root, self.staging, name_by=name_by, dump_wait_s=self.settings.dump_wait_s
        )
        self._outage = False
        self._checked_at = time.monotonic()
        self._backoff = 0.5
        self.status.server = {
            "url": self.settings.backend_url,
            "name_by": name_by,
            "boot_id": boot_id,
            "model_path": model_info.get("model_path"),
            "layers": self._server_layers,
        }
        self._set_status("ready")
        return True

    def _refuse_job(self, c: repo.Claimed) -> None:
        """The server captures other layers than the job asks for: fail the job, spend nothing."""
        reason = f"wrong_layers: the job asks for layers {c.job_layers}, the server captures {self._server_layers}"

        def refuse(s: Session) -> None:
            repo.release_interrupted(s, c, reason=reason)
            repo.fail_job(s, c.job_id, reason)

        self._db(refuse)
        log.warning("job %s refused: %s", c.job_id, reason)

    def _process(self, c: repo.Claimed) -> None:
        ids = np.frombuffer(c.input_ids, dtype="<i4").tolist()
        rid = f"hsx-{c.job_id}-{c.idx}-t{c.try_number}"
        info = c.job_model_info or {}
        expect = Expectation(
            layers=info.get("layers", c.job_layers), hidden_size=info.get("hidden_size"), dtype=info.get("dtype")
        )
        started = time.monotonic()
        try:
            dump = self.extractor.extract(
                ids, rid=rid, staged_name=f"{c.job_id}/{c.idx:09d}-t{c.try_number}", expect=expect
            )
        except BackendUnavailable as exc:
            self.metrics.attempt("interrupted", "server_unavailable")
            self.extractor, self._outage = None, True
            why = f"model server unavailable: {exc}"
            self._db(lambda s: repo.release_interrupted(s, c, reason=why))
            return
        except Exception as exc:  # any other failure is this attempt's, recorded, never a stuck sample
            if isinstance(exc, DumpRejected):
                reason = f"{exc.code}: {exc.reason}"
            elif isinstance(exc, BackendRejected):
                reason = f"server_error: {exc}"
            else:
                log.exception("unexpected error extracting %s/%s", c.job_id, c.sample_id)
                reason = f"internal_error: {type(exc).__name__}: {exc}"
            self.metrics.attempt("failed", reason)
            outcome = self._db(
                lambda s: repo.record_failed_attempt(s, c, reason=reason, max_attempts=self.settings.max_attempts)
            )
            log.info("sample %s/%s attempt %d: %s (%s)", c.job_id, c.sample_id, c.attempt, reason, outcome)
            return
        self.metrics.backend_latency(time.monotonic() - started)
        meta = dump.meta
        model = dict(
            self._model_info,
            layers=[int(i) for i in meta["layers"]],
            hidden_size=int(meta["hidden_size"]),
            dtype=meta["dtype"],
        )

        def stage(s: Session) -> bool:
            if c.job_model_info is None and repo.set_job_model_info(s, c.job_id, model) != model:
                repo.record_failed_attempt(
                    s,
                    c,
                    reason="wrong_model: dump differs from the job's model",
                    max_attempts=self.settings.max_attempts,
                )
                return False
            repo.mark_staged(
                s,
                c,
                writer=self.identity,
                staged_path=str(dump.path),
                observed_tokens=dump.num_tokens,
                dump_key=dump.key,
                boot_id=meta.get("boot_id"),
            )
            return True

        if not self._db(stage):
            shutil.rmtree(dump.path, ignore_errors=True)
            return
        self.metrics.attempt("ok")
        self.metrics.extracted(dump.num_tokens, dump.nbytes)
        # Only after the commit: a flush that started before it must not have swallowed this entry.
        with self._lock:
            pending = self._pending[c.job_id]
            pending.bytes += dump.nbytes
            if pending.bytes >= self.settings.shard_max_bytes:
                self._flush_wake.set()

    def _sweep(self) -> None:
        if self.extractor is None or self.extractor.name_by != "rid":
            return
        if time.monotonic() - self._swept_at < SWEEP_EVERY_S:
            return
        self._swept_at = time.monotonic()
        cutoff = time.time() - SWEEP_AGE_S
        for d in self.root.entries():
            try:
                if d.stat().st_mtime < cutoff:
                    shutil.rmtree(d, ignore_errors=True)
            except FileNotFoundError:
                pass

    # --- shards -------------------------------------------------------------------------------

    def _settle_job(self, job_id: str) -> None:
        """After a sample's outcome: flush this writer's staged samples once no queued sample can
        join them, then finish the job if that was the last of it."""
        job = self._db(lambda s: repo.get_job(s, job_id))
        drained = job is not None and job.n_queued == 0
        with self._lock:
            has_pending = job_id in self._pending
        if drained and has_pending:
            self._flush_wake.set()
        elif not has_pending:
            self._finish(job_id)

    def _flush_due(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = list(self._pending.items())
        for job_id, pending in due:
            job = self._db(lambda s, j=job_id: repo.get_job(s, j))
            # Drained: no queued sample is left to fill a shard; only running ones, which get the next.
            drained = job is None or job.n_queued == 0
            aged = now - pending.since >= self.settings.shard_max_wait_s
            if drained or aged or pending.bytes >= self.settings.shard_max_bytes:
                if self._flush(job_id, complete=drained or aged):
                    self._finish(job_id)

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
            if _disk_full(exc):
                self._paused = f"output disk full, extraction paused until there is room: {exc}"
                pending.since = time.monotonic() - self.settings.shard_max_wait_s + DISK_RETRY_S
            else:
                log.exception("job %s: writing a shard failed; its staged samples wait for the next try", job_id)
                pending.since = time.monotonic()
            left = pending.bytes
        else:
            self._paused = None
        if left:
            with self._lock:
                self._pending[job_id].bytes += left
                self._pending[job_id].since = pending.since
        with self._room:
            self._room.notify_all()
        return not left

    def _write_staged(self, job_id: str, complete: bool) -> int:
        """Write full shards (and the last one when `complete`); return the bytes left staged."""
        staged = self._db(lambda s: repo.staged_samples(s, self.identity, job_id))
        job = self._db(lambda s: repo.get_job(s, job_id))
        if not staged or job is None:
            return 0
        chunks: list[list[tuple]] = [[]]
        size, lost = 0, []
        for x in staged:
            try:
                dump = load_staged(Path(x.staged_path))
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
            self._db(
                lambda s: [repo.requeue_staged(s, job_id, [pk], f"staged dump unreadable: {why}") for pk, why in lost]
            )
        left = 0
        if chunks[-1] and not complete and size < self.settings.shard_max_bytes:
            chunks.pop()
            left = size
        for chunk in chunks:
            if chunk:
                self._write_shard(job, chunk)
        return left

    def _write_shard(self, job, pieces: list[tuple]) -> None:
        info, job_id = job.model_info, job.id
        number = self._db(lambda s: repo.reserve_shard_number(s, job_id))
        out = job_dir(self.settings.output_root, job_id) / shard_name(number)
        try:
            shard = write_shard(out, [p for _, p in pieces], info["layers"], info["dtype"], info["hidden_size"])
        except NonFiniteSamples as exc:
            # Only those samples failed: their attempts say why, the others get a shard without them.
            self._reject(job_id, [(x, exc.reasons[p.sample_id]) for x, p in pieces if p.sample_id in exc.reasons])
            rest = [(x, p) for x, p in pieces if p.sample_id not in exc.reasons]
            if rest:
                self._write_shard(job, rest)
            return
        placed = [(x.pk, off, p.num_tokens) for (x, p), off in zip(pieces, shard.offsets)]
        self._db(
            lambda s: repo.commit_shard(
                s, job_id, name=shard.name, nbytes=shard.bytes, sha256=shard.sha256, placed=placed
            )
        )
        for x, _ in pieces:
            shutil.rmtree(x.staged_path, ignore_errors=True)
        log.info(
            "job %s: wrote %s (%d samples, %d tokens, %d bytes)",
            job_id,
            shard.name,
            shard.num_samples,
            shard.num_tokens,
            shard.bytes,
        )

    def _reject(self, job_id: str, rejected: list[tuple]) -> None:
        for x, why in rejected:
            reason = f"non_finite: {why}"
            outcome = self._db(
                lambda s, pk=x.pk, why=reason: repo.reject_staged(
                    s, job_id, pk, reason=why, max_attempts=self.settings.max_attempts
                )
            )
            shutil.rmtree(x.staged_path, ignore_errors=True)
            self.metrics.attempt("rejected", reason)
            log.info("sample %s/%s: %s (%s)", job_id, x.sample_id, reason, outcome)

    def _finish(self, job_id: str) -> None:
        """End the job if it is settled; when its manifest cannot be written yet (disk full), the
        job stays unfinished and the flusher tries again."""
        try:
            final = self._db(lambda s: finish_job(s, job_id, self.settings.output_root))
        except OSError as exc:
            if _disk_full(exc):
                self._paused = f"output disk full, manifest of {job_id} not written yet: {exc}"
            log.warning("job %s: manifest not written yet: %s", job_id, exc)
            with self._lock:
                self._finish_due.add(job_id)
            return
        with self._lock:
            self._finish_due.discard(job_id)
        if final:
            known = {sh.name for sh in self._db(lambda s: repo.job_shards(s, job_id))}
            self._remove_leftovers(job_id, known)
            log.info("job %s %s; manifest at %s", job_id, final, job_dir(self.settings.output_root, job_id))

    def _retry_finishes(self) -> None:
        with self._lock:
            due = list(self._finish_due)
        for job_id in due:
            self._finish(job_id)

    def _remove_leftovers(self, job_id: str, known: set[str]) -> None:
        """Once a job is finished, nothing can still be writing into it: drop temp files and shards
        a crash left unrecorded, and its staging folder."""
        folder = job_dir(self.settings.output_root, job_id)
        for p in folder.glob("*"):
            if (p.name.startswith(".") and ".tmp-" in p.name) or (p.suffix == ".safetensors" and p.name not in known):
                p.unlink(missing_ok=True)
        shutil.rmtree(self.staging / job_id, ignore_errors=True)

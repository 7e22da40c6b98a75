"""The single writer for one dump root: claim a sample, extract it, stage it, write shards.

Only one writer may use a dump root: the file-system lock (DumpRoot.acquire) stops a second
process here, and the database allows one running sample per writer identity.
"""

from __future__ import annotations

import logging
import shutil
import socket
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from sqlalchemy.orm import Session, sessionmaker

from app.backends.dumps import DumpRejected, DumpRoot, load_staged
from app.backends.extract import Expectation, Extractor
from app.backends.sglang import BackendRejected, BackendUnavailable, SGLangClient
from app.config import Settings
from app.db import repository as repo
from app.manifests import job_dir, write_manifest
from app.scheduler.metrics import WriterMetrics
from app.scheduler.server_check import dump_breaking_settings
from app.storage.shards import ShardSample, shard_name, write_shard

log = logging.getLogger("hsx.writer")

IDLE_POLL_S = 0.2
MAX_BACKOFF_S = 30.0
SERVER_RECHECK_S = 60.0


@dataclass
class WriterStatus:
    state: str = "starting"  # starting | ready | waiting | refusing | stopped
    reason: str | None = None
    since: float = field(default_factory=time.time)
    server: dict | None = None

    def set(self, state: str, reason: str | None = None) -> None:
        if (state, reason) != (self.state, self.reason):
            self.state, self.reason, self.since = state, reason, time.time()
            if reason:
                log.warning("writer %s: %s", state, reason)


@dataclass
class _Pending:
    bytes: int = 0
    since: float = field(default_factory=time.monotonic)


def writer_identity(dump_root: Path) -> str:
    return f"{socket.gethostname()}:{Path(dump_root).resolve()}"


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
        self._checked_at = 0.0
        self._backoff = 0.5
        self._pending: dict[str, _Pending] = defaultdict(_Pending)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- life cycle -------------------------------------------------------------------------

    def acquire(self) -> None:
        """Lock the dump root; raises DumpRootBusy when another process holds it."""
        self.root.acquire()
        self.staging.mkdir(parents=True, exist_ok=True)

    def start_thread(self) -> None:
        """Recover what a crash left behind, then run the loop in the background."""
        with self.sessions.begin() as s:
            requeued, kept = repo.recover_writer(s, self.identity, lambda p: (Path(p) / "done").exists())
            # Samples staged before a restart join the next shard of their job.
            for sample in repo.staged_samples(s, self.identity):
                self._pending[sample.job_id]
        if requeued or kept:
            log.info("recovered: %d samples requeued, %d staged samples kept", requeued, kept)
        self._thread = threading.Thread(target=self._run, name="hsx-writer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=self.settings.request_timeout_s + 10)
        self.client.close()
        self.root.release()
        self.status.set("stopped")

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception:  # the loop must outlive any one failure; the sample's state says what happened
                log.exception("writer step failed")
                self._stop.wait(1.0)

    # --- one step -----------------------------------------------------------------------------

    def step(self) -> bool:
        """Process at most one sample; returns whether one was processed."""
        if not self._ensure_server():
            self._stop.wait(self._backoff)
            self._backoff = min(self._backoff * 2, MAX_BACKOFF_S)
            return False
        self._flush_due()
        with self.sessions.begin() as s:
            claimed = repo.claim_next(s, self.identity)
        if claimed is None:
            self._stop.wait(IDLE_POLL_S)
            return False
        self._process(claimed)
        self._settle_job(claimed.job_id)
        return True

    def _ensure_server(self) -> bool:
        if self.extractor is not None and time.monotonic() - self._checked_at < SERVER_RECHECK_S:
            return True
        try:
            model_info = self.client.model_info()
            server_info = self.client.server_info()
        except (BackendUnavailable, BackendRejected) as exc:
            self.extractor = None
            self.status.set("waiting", f"model server not ready: {exc}")
            return False
        problems = dump_breaking_settings(server_info)
        if problems:
            self.extractor = None
            self.status.set("refusing", "; ".join(problems))
            return False
        dump = server_info.get("hs_dump") or {}
        name_by = self.settings.name_by if self.settings.name_by != "auto" else dump.get("name_by", "counter")
        self._model_info = {
            "model_path": model_info.get("model_path"),
            "num_hidden_layers": model_info.get("num_hidden_layers"),
            "vocab_size": model_info.get("vocab_size"),
        }
        self.extractor = Extractor(self.client, self.root, self.staging, name_by=name_by,
                                   dump_wait_s=self.settings.dump_wait_s)
        self._checked_at = time.monotonic()
        self._backoff = 0.5
        self.status.server = {"url": self.settings.backend_url, "name_by": name_by, "boot_id": dump.get("boot_id"),
                              "model_path": model_info.get("model_path")}
        self.status.set("ready")
        return True

    def _process(self, c: repo.Claimed) -> None:
        ids = np.frombuffer(c.input_ids, dtype="<i4").tolist()
        rid = f"hsx-{c.job_id}-{c.idx}-t{c.try_number}"
        info = c.job_model_info or {}
        expect = Expectation(layers=info.get("layers", c.job_layers), hidden_size=info.get("hidden_size"),
                             dtype=info.get("dtype"))
        started = time.monotonic()
        try:
            dump = self.extractor.extract(ids, rid=rid, staged_name=f"{c.job_id}/{c.idx:09d}-t{c.try_number}",
                                          expect=expect)
        except BackendUnavailable as exc:
            self.metrics.attempt("interrupted", "server_unavailable")
            self.extractor = None
            with self.sessions.begin() as s:
                repo.release_interrupted(s, c, reason=f"model server unavailable: {exc}")
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
            with self.sessions.begin() as s:
                outcome = repo.record_failed_attempt(s, c, reason=reason, max_attempts=self.settings.max_attempts)
            log.info("sample %s/%s attempt %d: %s (%s)", c.job_id, c.sample_id, c.attempt, reason, outcome)
            return
        self.metrics.backend_latency(time.monotonic() - started)
        meta = dump.meta
        model = dict(self._model_info, layers=[int(i) for i in meta["layers"]],
                     hidden_size=int(meta["hidden_size"]), dtype=meta["dtype"])
        with self.sessions.begin() as s:
            recorded = repo.set_job_model_info(s, c.job_id, model) if c.job_model_info is None else c.job_model_info
            if recorded != model and c.job_model_info is None:
                shutil.rmtree(dump.path, ignore_errors=True)
                repo.record_failed_attempt(s, c, reason="wrong_model: dump differs from the job's model",
                                           max_attempts=self.settings.max_attempts)
                return
            repo.mark_staged(s, c, staged_path=str(dump.path), observed_tokens=dump.num_tokens,
                             dump_key=dump.key, boot_id=meta.get("boot_id"))
        self.metrics.attempt("ok")
        self.metrics.extracted(dump.num_tokens, dump.nbytes)
        pending = self._pending[c.job_id]
        pending.bytes += dump.nbytes
        if pending.bytes >= self.settings.shard_max_bytes:
            self._flush(c.job_id)

    # --- shards -------------------------------------------------------------------------------

    def _settle_job(self, job_id: str) -> None:
        """After a sample's outcome: flush this writer's staged samples once nothing else can
        join them, then finish the job if that was the last of it."""
        with self.sessions() as s:
            job = repo.get_job(s, job_id)
            idle = job is not None and job.n_queued == 0 and job.n_running == 0
        if idle and job_id in self._pending:
            self._flush(job_id)
        self._finish(job_id)

    def _flush_due(self) -> None:
        now = time.monotonic()
        for job_id, pending in list(self._pending.items()):
            with self.sessions() as s:
                job = repo.get_job(s, job_id)
                idle = job is None or (job.n_queued == 0 and job.n_running == 0)
            if idle or now - pending.since >= self.settings.shard_max_wait_s:
                self._flush(job_id)
                self._finish(job_id)

    def _flush(self, job_id: str) -> None:
        """Write this writer's staged samples of a job as one shard. On failure they stay staged
        and are tried again after shard_max_wait_s."""
        pending = self._pending.pop(job_id, None) or _Pending()
        try:
            self._write_staged(job_id)
        except Exception:
            log.exception("job %s: writing a shard failed; its staged samples wait for the next try", job_id)
            pending.since = time.monotonic()
            self._pending[job_id] = pending

    def _write_staged(self, job_id: str) -> None:
        with self.sessions() as s:
            staged = [x for x in repo.staged_samples(s, self.identity) if x.job_id == job_id]
            job = repo.get_job(s, job_id)
        if not staged or job is None:
            return
        pieces, lost = [], []
        for x in staged:
            try:
                dump = load_staged(Path(x.staged_path))
            except (DumpRejected, OSError) as exc:
                lost.append((x.pk, str(exc)))
                continue
            ids = np.frombuffer(x.input_ids, dtype="<i4").astype(np.int64)
            mask = (np.frombuffer(x.loss_mask, dtype=np.uint8) if x.loss_mask is not None
                    else np.ones(len(ids), dtype=np.uint8)).astype(np.int64)
            pieces.append((x, ShardSample(x.sample_id, ids, mask, dump.layers)))
        if lost:
            with self.sessions.begin() as s:
                for pk, why in lost:
                    repo.requeue_staged(s, job_id, [pk], f"staged dump unreadable: {why}")
        if not pieces:
            return
        info = job.model_info
        with self.sessions.begin() as s:
            number = repo.reserve_shard_number(s, job_id)
        out = job_dir(self.settings.output_root, job_id) / shard_name(number)
        shard = write_shard(out, [p for _, p in pieces], info["layers"], info["dtype"], info["hidden_size"])
        with self.sessions.begin() as s:
            repo.commit_shard(s, job_id, name=shard.name, nbytes=shard.bytes, sha256=shard.sha256,
                              placed=[(x.pk, off, p.num_tokens) for (x, p), off in zip(pieces, shard.offsets)])
        for x, _ in pieces:
            shutil.rmtree(x.staged_path, ignore_errors=True)
        log.info("job %s: wrote %s (%d samples, %d tokens, %d bytes)", job_id, shard.name, shard.num_samples,
                 shard.num_tokens, shard.bytes)

    def _finish(self, job_id: str) -> None:
        with self.sessions.begin() as s:
            finished = repo.finish_job_if_done(s, job_id)
        if not finished:
            return
        with self.sessions() as s:
            job = repo.get_job(s, job_id)
            path = write_manifest(s, job, self.settings.output_root)
        shutil.rmtree(self.staging / job_id, ignore_errors=True)
        log.info("job %s %s; manifest at %s", job_id, job.state, path)

"""The request loop: claim a sample, send it to the model server, find its dump, validate it,
stage it, and settle the sample's outcome.

The GPU should never wait on us, so the loop only sends, finds, validates and stages: a validated
dump is renamed out of the dump root (the root is clear again at once) and the shard flusher
writes it into a shard while the next request runs. In rid mode several slots keep requests in
flight at once; each slot claims under its own identity ("<writer>#<n>"), so the database still
holds one running sample per identity.

Whatever breaks, an attempt ends with a recorded outcome: a server that went away gives the
sample back unspent, anything else about the attempt spends it with a reason.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time

import numpy as np
from sqlalchemy.orm import Session

from hsx.backends.dumps import Dump, DumpRejected, keep_layers
from hsx.backends.engine import Engine, Expectation
from hsx.backends.final_norm import FinalNorm
from hsx.backends.http import BackendRejected, BackendUnavailable
from hsx.config import Settings
from hsx.db import repository as repo
from hsx.extraction.database import Database
from hsx.extraction.disk import DISK_RETRY_S, DiskPause
from hsx.extraction.flusher import ShardFlusher
from hsx.extraction.lease import Lease
from hsx.extraction.metrics import WriterMetrics
from hsx.extraction.server_watch import ServerWatch
from hsx.extraction.status import StatusReport
from hsx.layers import Wanted, choice_parts, resolve
from hsx.matching import Serves
from hsx.storage.safetensors_raw import TensorSpan

log = logging.getLogger("hsx.writer")

# An idle writer asks the database for work IDLE_POLL_S after finding none, then ever less often, up
# to IDLE_POLL_MAX_S: jobs created in this process wake it at once (notify_work); those created
# elsewhere (another API process, on Postgres) are found within IDLE_POLL_MAX_S, and an idle writer
# with many slots does not ask the database dozens of times a second.
IDLE_POLL_S = 0.2
IDLE_POLL_MAX_S = 2.0
# What requests whose answer was never read left in the dump root (Engine.leftovers: warm-up, health
# checks, other clients, answers lost to a restart) is swept once this old.
SWEEP_EVERY_S = 60.0
SWEEP_AGE_S = 120.0


class RequestLoop:
    def __init__(
        self,
        *,
        settings: Settings,
        identity: str,
        db: Database,
        server: ServerWatch,
        report: StatusReport,
        flusher: ShardFlusher,
        pause: DiskPause,
        metrics: WriterMetrics,
        stop: threading.Event,
        lease: Lease,
    ):
        self.settings = settings
        self.lease = lease
        self.identity = identity
        self.db = db
        self.server = server
        self.report = report
        self.flusher = flusher
        self.pause = pause
        self.metrics = metrics
        self.stop = stop
        self._work = threading.Event()  # set when a job may have new queued samples
        self._idle_lock = threading.Lock()
        self._empty_claims = 0  # claims that found nothing since work was last found, all slots together
        self._swept_at = 0.0

    def notify_work(self) -> None:
        with self._idle_lock:
            self._empty_claims = 0
        self._work.set()

    def _idle_wait_s(self) -> float:
        with self._idle_lock:
            self._empty_claims += 1
            return min(IDLE_POLL_MAX_S, IDLE_POLL_S * 2 ** min(self._empty_claims - 1, 8))

    def slot_identity(self, slot: int) -> str:
        return self.identity if slot == 0 else f"{self.identity}#{slot}"

    def step(self, slot: int = 0) -> bool:
        """One turn: process at most one sample; returns whether one was processed. Everything the
        turn records is fenced by the lease it started under."""
        with self.db.fenced(self.lease.epoch):
            return self._step(slot)

    def _step(self, slot: int) -> bool:
        engine = self._engine()
        if engine is None:
            self.stop.wait(self.server.backoff.next())
            return False
        if slot > 0 and not engine.concurrent:
            self.stop.wait(1.0)  # an engine that finds dumps by scanning the root takes one request at a time
            return False
        if self.pause.reason:
            self.report.set("waiting", self.pause.reason)
            self.stop.wait(DISK_RETRY_S)
            return False
        if not self.flusher.wait_for_room():
            return False
        self.report.set("ready")
        serves = self.server.serves()
        claimed = self.db.run(lambda s: repo.claim_next(s, self.slot_identity(slot), serves))
        if claimed is None:
            if slot == 0:
                self._sweep(engine)
            if not self.stop.is_set() and self._work.wait(self._idle_wait_s()):
                self._work.clear()
            return False
        if self._empty_claims:
            self.notify_work()  # work again after idling: the other slots look now, not at their next poll
        if claimed.queued_left == 0:
            # Nothing left to claim: the flushers look whether the job's staged samples fill a shard;
            # the rest waits for the requests still running, to go to the job's last shard with them.
            self.flusher.wake()
        self.flusher.settle(claimed.job_id, queued=self._process(claimed, engine, serves))
        return True

    def _engine(self) -> Engine | None:
        """The engine for the model server, None while it cannot take requests; what a check of the
        server finds becomes the writer's status."""
        engine, verdict = self.server.ensure()
        if verdict is not None:
            if verdict.server is not None:
                self.report.status.server = verdict.server
            self.report.set(verdict.state, verdict.reason)
        return engine

    def _process(self, c: repo.Claimed, engine: Engine, serves: Serves) -> int | None:
        """Run the claimed sample to its outcome; returns how many of its job's samples are queued
        when it was staged (None when it was not)."""
        ids = np.frombuffer(c.input_ids, dtype="<i4").tolist()
        rid = f"{engine.capture.rid_prefix}{c.job_id}-{c.idx}-t{c.try_number}"
        info = c.job_model_info or {}
        try:
            wanted = self._wanted(c.job_layers_key)
        except ValueError as exc:
            # Claimed by a worker whose server does not say its layers (it may claim any job): this model
            # cannot give the job's sets, which no attempt here can change.
            self._failed(c, f"wrong_layers: {exc}")
            return None
        expect = Expectation(
            layers=info.get("layers", c.job_layers or (wanted.layers if wanted is not None else None)),
            hidden_size=info.get("hidden_size"),
            dtype=info.get("dtype"),
        )
        norm = self._norm_needed(wanted)
        started = time.monotonic()
        dump = self._extract(c, engine, ids, rid=rid, expect=expect)
        if dump is None:
            return None
        self.metrics.backend_latency(time.monotonic() - started)
        dump = self._as_stored(c, dump, expect.layers, norm)
        if dump is None:
            return None
        meta = dump.meta
        model = dict(
            self.server.model_info,
            layers=[int(i) for i in meta["layers"]],
            hidden_size=int(meta["hidden_size"]),
            dtype=meta["dtype"],
        )
        if norm is not None:
            model.update(final_layer="post_norm", final_norm=norm.describe())

        def stage(s: Session) -> int | None:
            if c.job_model_info is None and repo.set_job_model_info(s, c.job_id, model, serves) != model:
                # Another worker stored the job's first sample meanwhile, from another model or
                # other layers: the sample is not at fault and goes back for a worker that matches.
                repo.release_interrupted(s, c, reason="the job's model was recorded meanwhile from another worker")
                return None
            repo.mark_staged(
                s,
                c,
                writer=self.identity,
                staged_path=str(dump.path),
                observed_tokens=dump.num_tokens,
                dump_key=dump.key,
                boot_id=meta.get("boot_id"),
                identity=dump.identity,
            )
            return repo.queued_left(s, c.job_id)

        try:
            queued = self.db.run(stage)
        except repo.LeaseLost:
            shutil.rmtree(dump.path, ignore_errors=True)  # the sample is someone else's now
            raise
        if queued is None:
            shutil.rmtree(dump.path, ignore_errors=True)
            return None
        self.metrics.attempt("ok")
        self.metrics.extracted(dump.num_tokens, dump.nbytes)
        if self.server.proved(dump.identity) and self.report.status.server is not None:
            self.report.status.server = {**self.report.status.server, "identity": self.server.identity}
            self.report.report()
        # Only after the commit: a flush that started before it must not have swallowed this sample.
        self.flusher.staged(c.job_id, c.sample_pk, dump.nbytes)
        return queued

    def _extract(
        self, c: repo.Claimed, engine: Engine, ids: list[int], *, rid: str, expect: Expectation
    ) -> Dump | None:
        """The sample's validated dump; None when the attempt ended otherwise, its outcome recorded."""
        try:
            return engine.extract(ids, rid=rid, staged_name=f"{c.job_id}/{c.idx:09d}-t{c.try_number}", expect=expect)
        except BackendUnavailable as exc:
            self._interrupted(c, f"model server unavailable: {exc}")
        except DumpRejected as exc:
            gone = self.server.gone_since(engine) if exc.never_came else None
            if gone is None:
                self._failed(c, f"{exc.code}: {exc.reason}")
            else:
                self._interrupted(c, f"{gone}; the dump of a request it answered went with it ({exc.code})")
        except BackendRejected as exc:
            self._failed(c, f"server_error: {exc}")
        except Exception as exc:  # any other failure is this attempt's, recorded, never a stuck sample
            log.exception("unexpected error extracting %s/%s", c.job_id, c.sample_id)
            self._failed(c, f"internal_error: {type(exc).__name__}: {exc}")
        return None

    def _interrupted(self, c: repo.Claimed, why: str) -> None:
        """The server, not the sample, failed: the sample goes back unspent, and nothing is sent until
        the server is checked again."""
        self.metrics.attempt("interrupted", "server_unavailable")
        self.server.lost()
        self.db.run(lambda s: repo.release_interrupted(s, c, reason=why))

    def _failed(self, c: repo.Claimed, reason: str) -> None:
        self.metrics.attempt("failed", reason)
        outcome = self.db.run(
            lambda s: repo.record_failed_attempt(s, c, reason=reason, max_attempts=self.settings.max_attempts)
        )
        log.info("sample %s/%s attempt %d: %s (%s)", c.job_id, c.sample_id, c.attempt, reason, outcome)

    def _wanted(self, key: str | None) -> Wanted | None:
        """What a job asking for sets (with any ids) needs of this worker's model; None for a job that asks
        for a list of layers or for any (its list, or its first sample's layers, is the expectation), and
        where the server does not say the model's depth."""
        num_layers = self.server.model_info.get("num_hidden_layers")
        if key is None or not choice_parts(key)[0] or not isinstance(num_layers, int):
            return None
        return resolve(key, num_layers)  # ValueError: the job's sets do not fit this model

    def _norm_needed(self, wanted: Wanted | None) -> FinalNorm | None:
        """The final norm hsx applies to the job's layer L: where its sets read L after the norm and the
        server gives it before."""
        num_layers = self.server.model_info.get("num_hidden_layers")
        if wanted is None or wanted.final_layer != "post_norm" or num_layers not in wanted.layers:
            return None
        if (self.server.model_info.get("final_layer") or "post_norm") == "post_norm":
            return None
        return self.server.final_norm

    def _as_stored(self, c: repo.Claimed, dump: Dump, layers: list[int] | None, norm: FinalNorm | None) -> Dump | None:
        """The staged dump as the job stores it: only the layers it asks for, and layer L after the model's
        final norm where hsx applies it (rewritten in place, before the sample is staged, so a staged
        sample's files are always what its shard will hold). None when that failed, its outcome recorded."""
        try:
            dump = keep_layers(dump, layers) if layers is not None else dump
            if norm is not None:
                num_layers = self.server.model_info["num_hidden_layers"]
                span = dump.layers[num_layers]
                if not isinstance(span, TensorSpan):
                    raise DumpRejected("wrong_layers", f"layer {num_layers} is not in a safetensors file to norm")
                norm.apply_in_place(span)
        except DumpRejected as exc:
            shutil.rmtree(dump.path, ignore_errors=True)
            self._failed(c, f"{exc.code}: {exc.reason}")
            return None
        except OSError as exc:
            shutil.rmtree(dump.path, ignore_errors=True)
            self._failed(c, f"internal_error: staging the dump: {exc}")
            return None
        return dump

    def _sweep(self, engine: Engine) -> None:
        """Remove what requests that were never read left in the root (their answer lost to a
        restart or a timeout): rid-named dumps, vLLM's files with their locks."""
        if time.monotonic() - self._swept_at < SWEEP_EVERY_S:
            return
        self._swept_at = time.monotonic()
        cutoff = time.time() - SWEEP_AGE_S
        for d in engine.leftovers():
            try:
                if d.stat().st_mtime >= cutoff:
                    continue
                if d.is_dir():
                    shutil.rmtree(d, ignore_errors=True)
                else:
                    d.unlink(missing_ok=True)
            except FileNotFoundError:
                pass

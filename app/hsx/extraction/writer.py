"""The single writer for one dump root: it owns the root, runs the request loops and the shard
flushers (settings.flushers of them) in their threads, and says how it is doing.

Only one writer may use a dump root: the file-system lock (DumpRoot.acquire) stops a second
process here, and the database allows one running sample per writer identity.

Whatever breaks, a sample ends stored with its own tensors or failed with a reason:
- the model server down or restarting: the attempt is given back unspent, the writer backs off
  and waits for /health before it trusts the server again, re-reading its settings
  (server_watch);
- the database down: every state change after an extraction is retried until it lands (the
  staged dump waits on disk meanwhile), and a crash in between is recovered at the next start
  (database, and start_thread here);
- a conversation that cannot be rendered or regenerated: it is skipped or failed with the reason
  (preparer), by the job's policy;
- the output disk full: no new sample is claimed; staged samples wait and the shard is
  written again once there is room (flusher, finishing).
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from hsx.backends.dumps import DumpRoot
from hsx.backends.engine import Server
from hsx.config import Settings
from hsx.db import repository as repo
from hsx.db.engine import make_engine
from hsx.extraction.database import Database
from hsx.extraction.disk import DiskPause
from hsx.extraction.finishing import JobFinisher
from hsx.extraction.flusher import ShardFlusher
from hsx.extraction.lease import Lease
from hsx.extraction.metrics import WriterMetrics
from hsx.extraction.preparer import Preparer, PreparerHealth
from hsx.extraction.request_loop import RequestLoop
from hsx.extraction.server_watch import ServerWatch
from hsx.extraction.status import StatusReport, WriterStatus

log = logging.getLogger("hsx.writer")


def writer_engine(settings: Settings) -> Engine:
    """The writer's database connections: a session stuck inside a transaction (a paused or cut-off
    writer) is ended by the database well within the lease, releasing its locks."""
    return make_engine(settings.database_url, idle_in_transaction_s=settings.lease_s / 3)


def writer_identity(dump_root: Path) -> str:
    return f"{socket.gethostname()}:{Path(dump_root).resolve()}"


class Writer:
    def __init__(self, settings: Settings, sessions: sessionmaker[Session]):
        self.settings = settings
        self.identity = writer_identity(settings.dump_root)
        self.root = DumpRoot(settings.dump_root)
        self.staging = settings.resolved_staging_dir()
        self.server = Server(
            settings.backend_url,
            self.root,
            self.staging,
            timeout_s=settings.request_timeout_s,
            dump_wait_s=settings.dump_wait_s,
            settle_s=settings.dump_settle_s,
            name_by=settings.name_by,
            capture_layers=settings.capture_layer_list(),
        )
        self.status = WriterStatus()
        self.metrics = WriterMetrics()
        self.slots = max(1, settings.max_in_flight)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        watch = ServerWatch(settings, self.server)
        self._db = Database(sessions, self.status, watch, self._stop, self.identity)
        self.lease = Lease(self.identity, settings.lease_s, self._db)
        self._report = StatusReport(self.status, self.lease, self._db, self._stats)
        pause = DiskPause()
        finisher = JobFinisher(settings.output_root, self.staging, self._db, pause)
        self._flusher = ShardFlusher(
            settings=settings,
            identity=self.identity,
            db=self._db,
            metrics=self.metrics,
            finisher=finisher,
            pause=pause,
            lease=self.lease,
        )
        self._requests = RequestLoop(
            settings=settings,
            identity=self.identity,
            db=self._db,
            server=watch,
            report=self._report,
            flusher=self._flusher,
            pause=pause,
            metrics=self.metrics,
            stop=self._stop,
            lease=self.lease,
        )
        self._preparer = Preparer(
            settings=settings,
            identity=self.identity,
            db=self._db,
            server=watch,
            finisher=finisher,
            queued=self._requests.notify_work,
            stop=self._stop,
        )

    def acquire(self) -> None:
        """Lock the dump root; raises DumpRootBusy when another process holds it."""
        self.root.acquire()
        self.staging.mkdir(parents=True, exist_ok=True)

    def start_thread(self) -> None:
        """Recover what a crash left behind, then run the request loops and the flusher in the background."""
        epoch = self.lease.register()
        self._report.report()
        staged = self._db.run(lambda s: repo.staged_samples(s, self.identity))
        self._flusher.adopt(staged)
        log.info("writer %s: lease %d, %d staged samples kept from before", self.identity, epoch, len(staged))
        self._threads = [
            threading.Thread(target=self._run, args=(self.step, i), name=f"hsx-writer-{i}", daemon=True)
            for i in range(self.slots)
        ]
        self._threads += [
            threading.Thread(target=self._run, args=(self.flush_step, i), name=f"hsx-flusher-{i}", daemon=True)
            for i in range(self.settings.flushers)
        ]
        self._threads.append(threading.Thread(target=self._heartbeats, name="hsx-heartbeat", daemon=True))
        self._threads.append(threading.Thread(target=self._prepare, name="hsx-preparer", daemon=True))
        for t in self._threads:
            t.start()

    def notify_work(self) -> None:
        """Queued samples may have appeared (a job created or retried in this process): idle
        request loops look now rather than at their next poll. Other processes' jobs are found
        by the poll."""
        self._requests.notify_work()

    def stop(self) -> None:
        self._stop.set()
        self._requests.notify_work()
        self._flusher.stop()
        for t in self._threads:
            t.join(timeout=self.settings.request_timeout_s + 10)
        self.status.set("stopped")
        try:
            self._report.stopped()
        except Exception:  # stopping must not fail because the database is gone
            log.warning("could not record the writer's stop")
        self.server.close()
        self.root.release()

    def step(self, slot: int = 0) -> bool:
        """One request loop turn in `slot`: process at most one sample; returns whether one was processed."""
        return self._requests.step(slot)

    def flush_step(self, _slot: int = 0) -> None:
        """A flusher's turn: write a shard that is due and finish the job it completes."""
        self._flusher.step()

    def _heartbeats(self) -> None:
        """Renew the lease and take over expired ones, on a thread of its own: a request that takes
        minutes must not cost the lease."""
        while not self._stop.wait(self.lease.renew_every_s):
            try:
                self._report.report()
                self.lease.take_over_expired()
            except Exception:
                log.exception("heartbeat failed")

    @property
    def preparer(self) -> PreparerHealth:
        """What the preparer last did (/healthz, /metrics)."""
        return self._preparer.health

    def _prepare(self) -> None:
        """Render (and regenerate) conversations ahead of the request loops; see hsx.extraction.preparer."""
        while not self._stop.is_set():
            try:
                self._preparer.run()
            except repo.LeaseLost as exc:
                self.lease.lost(exc.epoch, exc)

    def _stats(self) -> dict[str, object]:
        return {
            "samples_staged": self.metrics.samples_staged,
            "tokens_extracted": self.metrics.tokens_extracted,
            "tokens_per_s": self.metrics.tokens_per_second(),
            "preparer": self._preparer.health.as_dict(),
        }

    def _run(self, step: Callable[[int], object], slot: int) -> None:
        while not self._stop.is_set():
            try:
                step(slot)
            except repo.LeaseLost as exc:
                self.lease.lost(exc.epoch, exc)
            except Exception:  # the loop must outlive any one failure; the sample's state says what happened
                log.exception("writer step failed")
                self._stop.wait(1.0)

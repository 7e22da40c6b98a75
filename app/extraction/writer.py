"""The single writer for one dump root: it owns the root, runs the request loops and the shard
flusher in their threads, and says how it is doing.

Only one writer may use a dump root: the file-system lock (DumpRoot.acquire) stops a second
process here, and the database allows one running sample per writer identity.

Whatever breaks, a sample ends stored with its own tensors or failed with a reason:
- the model server down or restarting: the attempt is given back unspent, the writer backs off
  and waits for /health before it trusts the server again, re-reading its settings
  (server_watch);
- the database down: every state change after an extraction is retried until it lands (the
  staged dump waits on disk meanwhile), and a crash in between is recovered at the next start
  (database, and start_thread here);
- the output disk full: no new sample is claimed; staged samples wait and the shard is
  written again once there is room (flusher, finishing).
"""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path
from typing import Callable

from hsx.backends.dumps import DumpRoot
from hsx.backends.sglang import SGLangClient
from hsx.config import Settings
from hsx.db import repository as repo
from hsx.extraction.database import Database
from hsx.extraction.disk import DiskPause
from hsx.extraction.finishing import JobFinisher
from hsx.extraction.flusher import ShardFlusher
from hsx.extraction.metrics import WriterMetrics
from hsx.extraction.request_loop import RequestLoop
from hsx.extraction.server_watch import ServerWatch
from hsx.extraction.status import StatusReport, WriterStatus
from sqlalchemy.orm import Session, sessionmaker

log = logging.getLogger("hsx.writer")


def writer_identity(dump_root: Path) -> str:
    return f"{socket.gethostname()}:{Path(dump_root).resolve()}"


class Writer:
    def __init__(self, settings: Settings, sessions: sessionmaker[Session]):
        self.settings = settings
        self.identity = writer_identity(settings.dump_root)
        self.root = DumpRoot(settings.dump_root)
        self.staging = settings.resolved_staging_dir()
        self.client = SGLangClient(settings.backend_url, settings.request_timeout_s)
        self.status = WriterStatus()
        self.metrics = WriterMetrics()
        self.slots = max(1, settings.max_in_flight)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        server = ServerWatch(settings, self.client, self.root, self.staging)
        self._db = Database(sessions, self.status, server, self._stop)
        self._report = StatusReport(self.status, self.identity, self._db, self.metrics.tokens_per_second)
        pause = DiskPause()
        finisher = JobFinisher(settings.output_root, self.staging, self._db, pause)
        self._flusher = ShardFlusher(settings, self.identity, self._db, self.metrics, finisher, pause)
        self._requests = RequestLoop(
            settings,
            self.identity,
            self.root,
            self._db,
            server,
            self._report,
            self._flusher,
            pause,
            self.metrics,
            self._stop,
        )

    def acquire(self) -> None:
        """Lock the dump root; raises DumpRootBusy when another process holds it."""
        self.root.acquire()
        self.staging.mkdir(parents=True, exist_ok=True)

    def start_thread(self) -> None:
        """Recover what a crash left behind, then run the request loops and the flusher in the background."""
        requeued, kept = self._db.run(
            lambda s: repo.recover_writer(s, self.identity, lambda p: (Path(p) / "done").exists())
        )
        for job_id in {x.job_id for x in self._db.run(lambda s: repo.staged_samples(s, self.identity))}:
            self._flusher.adopt(job_id)
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
        self._requests.notify_work()

    def stop(self) -> None:
        self._stop.set()
        self._requests.notify_work()
        self._flusher.stop()
        for t in self._threads:
            t.join(timeout=self.settings.request_timeout_s + 10)
        self.status.set("stopped")
        try:
            self._report.report()
        except Exception:  # stopping must not fail because the database is gone
            log.warning("could not record the writer's stop")
        self.client.close()
        self.root.release()

    def step(self, slot: int = 0) -> bool:
        """One request loop turn in `slot`: process at most one sample; returns whether one was processed."""
        return self._requests.step(slot)

    def flush_step(self, _slot: int = 0) -> None:
        """The flusher's turn: write shards that are due and finish the jobs they complete."""
        self._flusher.step()

    def _run(self, step: Callable[[int], object], slot: int) -> None:
        while not self._stop.is_set():
            try:
                step(slot)
            except Exception:  # the loop must outlive any one failure; the sample's state says what happened
                log.exception("writer step failed")
                self._stop.wait(1.0)

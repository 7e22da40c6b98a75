"""Completing cancels in the background.

`POST /v1/jobs/{id}/cancel` only marks the job `cancelling`, so that it answers at once whatever the
job's size. A CancelSweeper then cancels the job's queued samples, --cancel-batch of them per
transaction (each takes the job row, then its samples, as every path that moves samples does), and
ends the job (manifest, then `cancelled`, then the removal of what a crash left in its folder) once
none of its samples is queued, running or staged;
when one is still running or staged, the writer that holds it ends the job after storing it.

Every API process and every `hsx worker` runs a sweeper that looks for cancelling jobs at start and
every few seconds: a cancel is completed whichever process took it, even one that has stopped or
crashed since. Sweepers of several processes may work on one job at once: each batch cancels what is
still queued under the job-row lock, so they only take turns.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from hsx.db import repository as repo
from hsx.extraction.finishing import finish_job, remove_leftovers
from hsx.states import JobState
from hsx.storage.output_root import OutputRootMismatch

log = logging.getLogger("hsx.cancel")

SWEEP_EVERY_S = 2.0


class CancelSweeper:
    def __init__(self, sessions: sessionmaker[Session], output_root: Path, batch: int, every_s: float = SWEEP_EVERY_S):
        self.sessions = sessions
        self.output_root = output_root
        self.batch = batch
        self.every_s = every_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="hsx-cancel", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """A job was just marked cancelling in this process: start on it now, not at the next sweep."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def sweep(self) -> list[str]:
        """Cancel the queued samples of every cancelling job and end those that are settled; returns
        the jobs that ended."""
        with self.sessions() as s:
            jobs = repo.cancelling_jobs(s)
        ended = []
        for job_id in jobs:
            if self._stop.is_set():
                break
            if self.drain(job_id) is not None:
                ended.append(job_id)
        return ended

    def drain(self, job_id: str) -> JobState | None:
        """Cancel the job's queued samples batch by batch, then end it if nothing of it is in
        flight; returns the state it ended in, or None while it is still cancelling."""
        cancelled = 0
        while not self._stop.is_set():
            with self.sessions.begin() as s:
                moved = repo.cancel_queued(s, job_id, self.batch)
            cancelled += moved
            if moved < self.batch:
                break
        else:
            return None  # stopped half-way: the next sweep, here or in another process, goes on
        if cancelled:
            log.info("job %s: %d queued samples cancelled", job_id, cancelled)
        try:
            with self.sessions.begin() as s:
                final = finish_job(s, job_id, self.output_root)
        except (OSError, OutputRootMismatch) as exc:
            log.warning("job %s: cancelled, manifest not written yet: %s", job_id, exc)
            return None
        if final is not None:
            with self.sessions() as s:
                remove_leftovers(s, job_id, self.output_root)
        return final

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.sweep()
            except (OperationalError, InterfaceError) as exc:
                log.warning("cancelling jobs: database unavailable, trying again: %s", exc.orig)
            except Exception:  # the loop must outlive any one failure; the next sweep tries again
                log.exception("cancelling jobs failed")
            self._wake.wait(self.every_s)

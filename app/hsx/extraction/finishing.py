"""Finishing a job once its samples are settled: its manifest, then its terminal state, then the
removal of what a crash may have left in its folder.

A manifest that cannot be written yet (the disk is full, or the output root is not the database's)
leaves the job unfinished; it is tried again until it lands, so a finished job always has its
manifest.
"""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path

from sqlalchemy.orm import Session

from hsx.db import repository as repo
from hsx.extraction.database import Database
from hsx.extraction.disk import DiskPause, output_blocked
from hsx.extraction.output_root import shared_output_root
from hsx.manifest import build_manifest, job_dir, write_manifest
from hsx.states import JobState
from hsx.storage.output_root import OutputRootMismatch

log = logging.getLogger("hsx.writer")


def finish_job(session: Session, job_id: str, output_root: Path) -> JobState | None:
    """End a job whose samples are all settled: manifest.json first, then the terminal state, so
    a finished job always has its manifest. Returns the state it ended in, or None."""
    job = repo.get_job(session, job_id)
    if job is None:
        return None
    final = repo.final_state(job)
    if final is None:
        return None
    shared_output_root(session, output_root)
    write_manifest(job_dir(output_root, job.id), build_manifest(session, job, final))
    return final if repo.finish_job_if_done(session, job_id) else None


def remove_leftovers(session: Session, job_id: str, output_root: Path) -> None:
    """Once a job is finished, nothing can still be writing into it: drop the temp files and the
    shards a crash left unrecorded in its folder. Whoever ended the job calls it (a writer, or a
    cancel sweeper in any process); a writer also drops the job's staging folder, on its own node."""
    known = {sh.name for sh in repo.job_shards(session, job_id)}
    for p in job_dir(output_root, job_id).glob("*"):
        if (p.name.startswith(".") and ".tmp-" in p.name) or (p.suffix == ".safetensors" and p.name not in known):
            p.unlink(missing_ok=True)


class JobFinisher:
    def __init__(self, output_root: Path, staging: Path, db: Database, pause: DiskPause):
        self.output_root = output_root
        self.staging = staging
        self.db = db
        self.pause = pause
        self._due: set[str] = set()  # jobs whose manifest could not be written yet
        self._lock = threading.Lock()
        # Several threads may find a job settled at once (flushers, request loops): one finishes it,
        # the others then find it finished and write nothing.
        self._finishing = threading.Lock()

    def finish(self, job_id: str) -> JobState | None:
        """End the job if it is settled; returns the state it ended in, or None. When its manifest
        cannot be written yet (or the lease was lost meanwhile), the job stays unfinished and
        retry_due tries again."""
        try:
            with self._finishing:
                final = self.db.run(lambda s: finish_job(s, job_id, self.output_root))
        except (OSError, OutputRootMismatch, repo.LeaseLost) as exc:
            with self._lock:
                self._due.add(job_id)
            if isinstance(exc, repo.LeaseLost):
                raise
            blocked = output_blocked(exc)
            if blocked:
                self.pause.reason = f"{blocked}, manifest of {job_id} not written yet: {exc}"
            log.warning("job %s: manifest not written yet: %s", job_id, exc)
            return None
        with self._lock:
            self._due.discard(job_id)
        if final:
            self.db.run(lambda s: remove_leftovers(s, job_id, self.output_root))
            shutil.rmtree(self.staging / job_id, ignore_errors=True)
            log.info("job %s %s; manifest at %s", job_id, final, job_dir(self.output_root, job_id))
        return final

    def retry_due(self) -> None:
        with self._lock:
            due = list(self._due)
        for job_id in due:
            self.finish(job_id)

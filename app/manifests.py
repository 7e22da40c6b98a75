"""Finishing a job: its manifest written next to the shards, then its terminal state."""

from __future__ import annotations

from pathlib import Path

from hsx.db import repository as repo
from hsx.manifest import build_manifest, job_dir, write_manifest
from sqlalchemy.orm import Session


def finish_job(session: Session, job_id: str, output_root: Path) -> str | None:
    """End a job whose samples are all settled: manifest.json first, then the terminal state, so
    a finished job always has its manifest. Returns the state it ended in, or None."""
    job = repo.get_job(session, job_id)
    final = None if job is None else repo.final_state(job)
    if job is None or final is None:
        return None
    write_manifest(job_dir(output_root, job.id), build_manifest(session, job, final))
    return final if repo.finish_job_if_done(session, job_id) else None

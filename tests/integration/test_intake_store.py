"""Storing a checked job (hsx.service.intake.store) on SQLite and Postgres: its size estimate, and the
disk check against the volume's free space and what active jobs still have to write; a refused job
stores nothing."""

from __future__ import annotations

import json
import shutil

import pytest
from sqlalchemy import func, select

from hsx.db.models import JobRow, SampleRow
from hsx.service.errors import InsufficientStorage
from hsx.service.intake import DiskCheck, Ingest, Limits, parse_sample, store


def limits_for(estimate: int) -> Limits:
    """Limits under which a one-token sample is estimated at `estimate` bytes (one layer of bfloat16)."""
    return Limits(layers=[1], hidden_size=(estimate - 16) // 2, dtype="bfloat16")


def create(sessions, limits: Limits, disk: DiskCheck, name: str) -> JobRow:
    ingest = Ingest(limits)
    try:
        ingest.feed(*parse_sample(0, json.dumps({"input_ids": [1]}).encode(), {}))
        with sessions.begin() as s:
            return store(
                s, ingest.finish(), limits, name=name, layers=None, idempotency_key=None, request_sha256="x", disk=disk
            )
    finally:
        ingest.close()


def counts(sessions) -> tuple[int, int]:
    with sessions() as s:
        return s.scalar(select(func.count()).select_from(JobRow)), s.scalar(select(func.count()).select_from(SampleRow))


def test_a_job_is_checked_against_free_space_and_active_jobs_once_each(sessions, tmp_path):
    free = shutil.disk_usage(tmp_path).free
    target = free * 6 // 10 // 2 * 2  # even: 16 bytes of ids and mask plus 2-byte values
    big = limits_for(target)
    # A job of 60% of the free space fits when nothing else is pending: its own estimate counts once.
    first = create(sessions, big, DiskCheck(tmp_path, "refuse"), "first")
    assert first.estimated_bytes == target and first.disk_warning is None
    # The same again does not fit next to the first, still queued.
    with pytest.raises(InsufficientStorage) as exc:
        create(sessions, big, DiskCheck(tmp_path, "refuse"), "second")
    assert exc.value.status == 507 and exc.value.extra["pending_bytes"] == first.estimated_bytes
    assert counts(sessions) == (1, 1)
    warned = create(sessions, big, DiskCheck(tmp_path, "warn"), "warned")
    assert warned.disk_warning and "bytes free" in warned.disk_warning
    assert create(sessions, big, DiskCheck(tmp_path, "off"), "unchecked").disk_warning is None
    assert counts(sessions) == (3, 3)


def test_without_the_servers_shape_there_is_no_estimate(sessions, tmp_path):
    job = create(sessions, Limits(), DiskCheck(tmp_path, "refuse"), "unknown")
    assert job.estimated_bytes is None and job.disk_warning is None

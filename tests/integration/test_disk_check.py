"""The disk check at job creation on SQLite and Postgres: a new job's estimated bytes count once, on
top of what the other active jobs still have to write, against the output volume's real free space.

The sizes are fractions of what `shutil.disk_usage` reports for the output folder, reached through
the job's real size estimate (tokens x layers x hidden size x dtype), so the volume is never filled.
"""

from __future__ import annotations

import shutil

import pytest
from sqlalchemy import func, select

from hsx.db.models import JobRow
from hsx.service.errors import InsufficientStorage
from hsx.service.intake import DiskCheck, Ingest, Limits, store
from hsx.wire import JobOptions, SampleIn

TOKENS = 10
PER_TOKEN_EXTRA = 16  # int64 input_ids and loss_mask


def limits_needing(nbytes: int) -> Limits:
    """Limits under which a job of TOKENS tokens is estimated at about `nbytes` (one float32 layer)."""
    hidden = max(1, (nbytes // TOKENS - PER_TOKEN_EXTRA) // 4)
    return Limits(layers=[2], hidden_size=hidden, dtype="float32")


def create(sessions, limits: Limits, disk: DiskCheck, encoding: str = "raw") -> JobRow:
    options = JobOptions(encoding=encoding)
    ingest = Ingest(limits, options)
    try:
        ingest.feed(0, SampleIn(input_ids=list(range(1, TOKENS + 1))), {})
        spool = ingest.finish()
        with sessions.begin() as s:
            return store(
                s,
                spool,
                limits,
                name=None,
                layers=None,
                idempotency_key=None,
                request_sha256="-",
                disk=disk,
                options=options,
            )
    finally:
        ingest.close()


def job_count(sessions) -> int:
    with sessions() as s:
        return s.execute(select(func.count()).select_from(JobRow)).scalar_one()


def test_a_job_between_half_and_all_of_the_free_space_fits(sessions, tmp_path):
    free = shutil.disk_usage(tmp_path).free
    job = create(sessions, limits_needing(free * 6 // 10), DiskCheck(tmp_path, "refuse"))
    assert job.estimated_bytes is not None and free // 2 < job.estimated_bytes < free
    assert job.disk_warning is None
    assert job_count(sessions) == 1


def test_a_job_larger_than_the_free_space_is_refused_and_stores_nothing(sessions, tmp_path):
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(InsufficientStorage) as refused:
        create(sessions, limits_needing(free * 3 // 2), DiskCheck(tmp_path, "refuse"))
    problem = refused.value.extra
    assert problem["pending_bytes"] == 0, "the refused job's own bytes are not counted as another job's"
    assert problem["needed_bytes"] > problem["free_bytes"]
    assert job_count(sessions) == 0


def test_the_other_active_jobs_still_count(sessions, tmp_path):
    free = shutil.disk_usage(tmp_path).free
    first = create(sessions, limits_needing(free * 6 // 10), DiskCheck(tmp_path, "refuse"))
    warned = create(sessions, limits_needing(free * 6 // 10), DiskCheck(tmp_path, "warn"))
    assert warned.disk_warning is not None and f"active jobs {first.estimated_bytes:,} more" in warned.disk_warning
    with pytest.raises(InsufficientStorage) as refused:
        create(sessions, limits_needing(free * 6 // 10), DiskCheck(tmp_path, "refuse"))
    assert refused.value.extra["pending_bytes"] == first.estimated_bytes + warned.estimated_bytes
    assert job_count(sessions) == 2


def test_the_estimate_and_the_check_take_the_encodings_ratio(sessions, tmp_path):
    """A job too large for the volume raw fits in fp8 (one byte a value and a float32 scale a row) and
    lossless (at most 0.9x a float32's bytes); the estimates say what each stores."""
    free = shutil.disk_usage(tmp_path).free
    limits = limits_needing(free * 11 // 10)
    hidden = limits.hidden_size
    with pytest.raises(InsufficientStorage):
        create(sessions, limits, DiskCheck(tmp_path, "refuse"))
    fp8 = create(sessions, limits, DiskCheck(tmp_path, "refuse"), "fp8")
    assert fp8.estimated_bytes == TOKENS * (hidden + 4 + PER_TOKEN_EXTRA)
    lossless = create(sessions, limits, DiskCheck(tmp_path, "warn"), "lossless")
    assert lossless.estimated_bytes == TOKENS * (-(-hidden * 4 * 9 // 10) + PER_TOKEN_EXTRA)
    assert job_count(sessions) == 2

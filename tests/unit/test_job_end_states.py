"""How a job ends (repository.final_state) and what `hsx submit --wait` / `hsx status --watch` exit with:
"nothing stored" (failed) is told apart from "a few samples failed" (partial)."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from hsx.cli.client.common import EXIT_FAILED, EXIT_PARTIAL, outcome
from hsx.db.models import JobRow
from hsx.db.repository import final_state
from hsx.sdk.models import Job
from hsx.service.views import job_out
from hsx.states import JobState

COUNTERS = ("n_preparing", "n_queued", "n_running", "n_staged", "n_succeeded", "n_failed", "n_cancelled", "n_skipped")


def job_row(state: JobState = JobState.RUNNING, **counts: int) -> JobRow:
    values = dict.fromkeys(COUNTERS, 0) | counts
    return JobRow(
        id="job_x",
        state=state,
        created_at=datetime.now(timezone.utc),
        num_samples=sum(values.values()),
        tokens_total=0,
        tokens_done=0,
        tokens_staged=0,
        shards_written=0,
        **values,
    )


@pytest.mark.parametrize(
    "counts,expected",
    [
        ({"n_succeeded": 300}, JobState.SUCCEEDED),
        ({"n_succeeded": 298, "n_skipped": 2}, JobState.SUCCEEDED),
        ({"n_succeeded": 298, "n_failed": 2}, JobState.PARTIAL),
        ({"n_failed": 300}, JobState.FAILED),
        ({"n_skipped": 3}, JobState.FAILED),
        ({"n_succeeded": 1, "n_preparing": 1}, None),
        ({"n_succeeded": 1, "n_queued": 1}, None),
        ({"n_succeeded": 1, "n_staged": 1}, None),
    ],
)
def test_a_job_ends_by_what_it_stored(counts, expected):
    assert final_state(job_row(**counts)) == expected


def test_a_cancelling_job_ends_cancelled_once_nothing_is_in_flight():
    assert final_state(job_row(JobState.CANCELLING, n_succeeded=1, n_cancelled=9)) == JobState.CANCELLED
    assert final_state(job_row(JobState.CANCELLING, n_preparing=2)) is None


@pytest.mark.parametrize(
    "state,counts,code,said",
    [
        (JobState.SUCCEEDED, {"n_succeeded": 3}, 0, ""),
        (JobState.PARTIAL, {"n_succeeded": 298, "n_failed": 2}, EXIT_PARTIAL, "298 of 300 stored, 2 failed"),
        (JobState.FAILED, {"n_failed": 2}, EXIT_FAILED, "2 failed"),
        (JobState.CANCELLED, {"n_cancelled": 2}, EXIT_FAILED, "2 cancelled"),
    ],
)
def test_the_exit_status_tells_partial_from_failed(capsys, state, counts, code, said):
    job = Job.model_validate(job_out(job_row(state, **counts)).model_dump())
    assert outcome(job, as_json=False) == code
    assert said in capsys.readouterr().err
    assert EXIT_PARTIAL not in (0, EXIT_FAILED, 2)  # 2 is a usage error

"""Why a job waits, on every screen a person follows it on: `hsx submit --wait` and `hsx status --watch`
print it once each time it changes, above the progress line (on a terminal and in a log alike), `hsx status`
under it, the SDK's wait logs it and names it when it times out."""

from __future__ import annotations

import io
import logging
from datetime import datetime, timezone

import pytest

from hsx.cli.client.common import Progress, waiting_line
from hsx.db.models import JobRow
from hsx.sdk._core import Poll
from hsx.sdk.models import Job
from hsx.service.views import job_out
from hsx.states import JobState

NO_LAYERS = "no live worker serves this job: it needs layers [2, 4, 5, 8]; host:/dumps gives layers [2, 4, 5]"


def job(waiting: str | None, state: JobState = JobState.QUEUED, queued: int = 6) -> Job:
    row = JobRow(
        id="job_w",
        state=state,
        created_at=datetime.now(timezone.utc),
        num_samples=6,
        tokens_total=60,
        tokens_done=0,
        tokens_staged=0,
        shards_written=0,
        n_preparing=0,
        n_queued=queued,
        n_running=0,
        n_staged=0,
        n_succeeded=6 - queued,
        n_failed=0,
        n_cancelled=0,
        n_skipped=0,
        n_truncated=0,
    )
    return Job.model_validate(job_out(row, waiting).model_dump())


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stream", [io.StringIO(), Terminal()], ids=["log", "terminal"])
def test_the_reason_is_said_once_each_time_it_changes_above_the_progress(stream):
    progress = Progress(stream=stream)
    for snapshot in (job(None), job(NO_LAYERS), job(NO_LAYERS), job("model server not ready"), job(None, queued=0)):
        progress(snapshot)
    progress.close()
    text = stream.getvalue()
    assert text.count(f"waiting: {NO_LAYERS}") == 1 and text.count("waiting: model server not ready") == 1
    assert text.index("waiting: model") > text.index("waiting: no live worker")
    lines = [line.split("\r\033[K")[-1] for line in text.splitlines()]
    assert all(not line.startswith("[") or "samples" in line for line in lines)


def test_a_job_that_does_not_wait_has_no_such_line():
    assert waiting_line(job(None)) is None
    assert waiting_line(job(NO_LAYERS)) == f"waiting: {NO_LAYERS}"
    assert job(NO_LAYERS, state=JobState.SUCCEEDED, queued=0).waiting_reason is None


def test_the_sdks_wait_logs_the_reason_and_names_it_when_it_times_out(caplog):
    poll = Poll("job_w", 0.0, 0.01, 0.01, None)
    with caplog.at_level(logging.INFO, logger="hsx.sdk"):
        for snapshot in (job(NO_LAYERS), job(NO_LAYERS), job(None)):
            assert not poll.finished(snapshot)
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"job job_w waits: {NO_LAYERS}", "job job_w no longer waits"]
    poll.finished(job(NO_LAYERS))
    with pytest.raises(TimeoutError, match="still queued, waiting: no live worker serves this job"):
        poll.pause()

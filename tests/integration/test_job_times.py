"""A job's time from its creation, with its conversations' preparation and its extraction apart, on SQLite and
Postgres: the job as the API answers it (prepared_at, elapsed_s, preparing_s, extracting_s) and as `hsx status`
says it. A writer on the database writes real shards, the preparer's and request loop's parts played by hand
(tests.support.writer_stack); the HTTP API in this process answers."""

from __future__ import annotations

import time
from datetime import datetime

import numpy as np
import pytest
from fastapi.testclient import TestClient

from hsx.api.app import create_app
from hsx.cli.client.status import describe
from hsx.db import repository as repo
from hsx.sdk.models import Job
from hsx.states import SampleState
from tests.support.writer_stack import LAYERS, TOKENS, Stack

PREPARING_S = 1.5  # how long the test's "preparer" takes before it stores the conversations
CONVERSATION = '[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]'


@pytest.fixture
def stack(tmp_path, database_url):
    made = Stack(tmp_path, database_url)
    yield made
    made.stop()


@pytest.fixture
def api(stack):
    settings = stack.settings.model_copy(update={"run_writer": False, "api_tokens": ""})
    with TestClient(create_app(settings)) as client:
        yield client


def job(api: TestClient, job_id: str) -> dict:
    resp = api.get(f"/v1/jobs/{job_id}")
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_elapsed_time_counts_from_creation_with_preparation_and_extraction_apart(stack, api):
    with stack.sessions.begin() as s:
        builder = repo.JobBuilder(s, name=None, layers=LAYERS)
        builder.add([repo.NewSample(f"c{i}", b"", None, 0, SampleState.PREPARING, CONVERSATION) for i in range(3)])
        job_id = builder.finish().id
    waiting = job(api, job_id)
    assert waiting["prepared_at"] is None and waiting["extracting_s"] is None
    assert waiting["preparing_s"] is not None and waiting["elapsed_s"] >= waiting["preparing_s"], "to now, so far"

    time.sleep(PREPARING_S)
    ids = np.arange(1, TOKENS + 1, dtype="<i4").tobytes()
    with stack.sessions.begin() as s:
        claimed = repo.claim_preparing(s, job_id, stack.writer.identity, 10)
    with stack.sessions.begin() as s:
        prepared = [repo.Prepared(c.pk, SampleState.QUEUED, ids, None, TOKENS) for c in claimed]
        assert repo.store_prepared(s, job_id, stack.writer.identity, prepared) == 3
    ready = job(api, job_id)
    assert ready["prepared_at"] is not None and ready["preparing_s"] >= PREPARING_S
    assert ready["extracting_s"] is None, "nothing claimed yet"

    stack.start()
    stack.extract(3)
    stack.finished(job_id)
    done = job(api, job_id)
    created, finished = (datetime.fromisoformat(done[k]) for k in ("created_at", "finished_at"))
    assert done["state"] == "succeeded"
    assert done["elapsed_s"] == pytest.approx((finished - created).total_seconds(), abs=0.002)
    assert done["preparing_s"] == ready["preparing_s"], "its preparation ended when the last conversation did"
    assert 0 <= done["extracting_s"] <= done["elapsed_s"] - done["preparing_s"] + 0.002, "extraction came after"
    assert job(api, job_id)["elapsed_s"] == done["elapsed_s"], "a finished job's times stay"

    said = describe(Job.model_validate(done))
    finished_line = next(line for line in said if line.startswith("finished "))
    assert f"(preparing {round(done['preparing_s'])}s, extracting {round(done['extracting_s'])}s)" in finished_line
    assert f" after {round(done['elapsed_s'])}s " in finished_line


def test_a_job_of_token_ids_has_no_preparation(stack, api):
    job_id = stack.job(2)
    queued = job(api, job_id)
    assert queued["prepared_at"] is None and queued["preparing_s"] is None and queued["extracting_s"] is None
    assert describe(Job.model_validate(queued))[1].startswith("elapsed ")
    stack.start()
    stack.extract(2)
    stack.finished(job_id)
    done = job(api, job_id)
    assert done["preparing_s"] is None and done["extracting_s"] <= done["elapsed_s"]
    assert "preparing" not in describe(Job.model_validate(done))[1]

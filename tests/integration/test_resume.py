"""A cancelled job resumed by a retry, on SQLite and Postgres: the samples the cancel left unrun are queued
again and the stored ones kept, the job's shard names and commit feed go on without a gap or a repeat, and
the manifest it writes when it ends again lists every stored sample once. A writer on the database writes
real shards (the request loop's part played by hand, tests.support.writer_stack); the HTTP API in this
process (no writer of its own) takes the cancel and the retry."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from hsx.api.app import create_app
from hsx.db import repository as repo
from hsx.manifest import load_manifest
from hsx.states import SampleState
from tests.support.api import problem
from tests.support.writer_stack import PER_SHARD, Stack


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


def feed(api: TestClient, job_id: str, **params) -> dict:
    resp = api.get(f"/v1/jobs/{job_id}/shards", params=params)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_a_cancelled_job_resumes_where_it_stopped_with_one_feed_and_one_manifest(stack, api):
    n = 4 * PER_SHARD + 2
    job_id = stack.job(n)
    stack.start()
    stack.extract(2 * PER_SHARD)  # two whole shards
    in_flight = stack.claim()
    cancelled = api.post(f"/v1/jobs/{job_id}/cancel").json()
    assert cancelled["state"] == "cancelling"
    retried_early = problem(api.post(f"/v1/jobs/{job_id}/retry"), 409)
    assert "cancelling" in retried_early["detail"] and "once it is cancelled" in retried_early["detail"]
    stack.stage(in_flight)  # a sample in flight when the cancel came is stored
    assert stack.finished(job_id).state == "cancelled"
    stopped = feed(api, job_id)
    assert stopped["complete"] and [s["seq"] for s in stopped["data"]] == [1, 2, 3]
    before = load_manifest(stack.settings.output_root / job_id)
    assert len(before.samples) == 2 * PER_SHARD + 1

    resp = api.post(f"/v1/jobs/{job_id}/retry")
    assert resp.status_code == 200, resp.text
    resumed = resp.json()
    left = n - 2 * PER_SHARD - 1
    assert resumed["state"] == "running" and resumed["finished_at"] is None
    assert resumed["cancel_requested_at"] is None
    assert (resumed["counts"]["queued"], resumed["counts"]["cancelled"], resumed["counts"]["succeeded"]) == (
        left,
        0,
        2 * PER_SHARD + 1,
    )
    opened = feed(api, job_id, after=3)
    assert not opened["complete"] and opened["job_state"] == "running" and opened["committed"] == 3
    with stack.sessions() as s:
        again = repo.list_samples(s, job_id, state="queued", after_idx=-1, limit=n)
    assert len(again) == left and all(x.attempts == 0 for x in again), "a fresh attempt budget"

    stack.extract(left)
    job = stack.finished(job_id)
    assert job.state == "succeeded" and (job.n_succeeded, job.n_cancelled, job.n_queued) == (n, 0, 0)

    whole = feed(api, job_id)
    assert whole["complete"] and [s["seq"] for s in whole["data"]] == list(range(1, 7))
    names = [s["name"] for s in whole["data"]]
    assert names[:3] == [s["name"] for s in stopped["data"]], "the shards of before the cancel keep their places"
    assert len(set(names)) == len(names)
    stored = [x["id"] for s in whole["data"] for x in s["samples"]]
    assert sorted(stored) == [f"s{i:03d}" for i in range(n)], "every sample stored once"

    manifest = load_manifest(stack.settings.output_root / job_id)
    assert sorted(s.id for s in manifest.samples) == [f"s{i:03d}" for i in range(n)]
    assert [(s.name, s.seq) for s in manifest.shards] == [(s["name"], s["seq"]) for s in whole["data"]]
    assert api.post(f"/v1/jobs/{job_id}/verify").json()["ok"] is True
    assert "no failed or cancelled samples" in problem(api.post(f"/v1/jobs/{job_id}/retry"), 409)["detail"]


def test_a_retry_sends_unprepared_conversations_back_to_their_preparation(sessions):
    """Conversations the cancel caught before they were rendered are prepared again; those rendered are queued
    again with their ids. The job's preparation is dated when its last conversation leaves `preparing`, and
    starts over with the retry."""
    conversation = '[{"role": "user", "content": "hi"}]'
    with sessions.begin() as s:
        builder = repo.JobBuilder(s, name=None, layers=None)
        builder.add([repo.NewSample(f"c{i}", b"", None, 0, SampleState.PREPARING, conversation) for i in range(3)])
        job_id = builder.finish().id
    with sessions.begin() as s:
        claimed = repo.claim_preparing(s, job_id, "host:/d", 2)
    ids = np.arange(1, 5, dtype="<i4").tobytes()
    with sessions.begin() as s:
        results = [repo.Prepared(c.pk, SampleState.QUEUED, ids, None, 4) for c in claimed]
        assert repo.store_prepared(s, job_id, "host:/d", results) == 2
    with sessions() as s:
        job = repo.get_job(s, job_id)
        assert job.prepared_at is None and (job.n_preparing, job.n_queued, job.tokens_total) == (1, 2, 8)
    with sessions.begin() as s:
        repo.cancel_job(s, job_id)
    with sessions.begin() as s:
        assert repo.cancel_queued(s, job_id, 10) == 1  # the conversation not yet rendered, at once
    with sessions.begin() as s:
        assert repo.cancel_queued(s, job_id, 10) == 2
    with sessions() as s:
        job = repo.get_job(s, job_id)
        assert job.prepared_at is not None, "its preparation ended with the cancel"
        assert (job.n_preparing, job.n_queued, job.n_cancelled) == (0, 0, 3)
    with sessions.begin() as s:
        assert repo.finish_job_if_done(s, job_id)
    with sessions.begin() as s:
        assert repo.retry_job(s, job_id) == 3
    with sessions() as s:
        job = repo.get_job(s, job_id)
        assert (job.state, job.n_preparing, job.n_queued, job.n_cancelled) == ("queued", 1, 2, 0)
        assert job.prepared_at is None and job.finished_at is None and job.tokens_total == 8
        assert job.n_requeued == 0, "none of them was tried before"

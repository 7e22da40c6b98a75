"""A job's commit feed, its consumers and what follows from them, on SQLite and Postgres: a writer on the
database writes real shards (the request loop's part played by hand, tests.support.writer_stack) and the
HTTP API in this process (no writer of its own) answers the feed, its long poll, the consumers' routes,
retention and back-pressure."""

from __future__ import annotations

import threading
import time

import pytest
from fastapi.testclient import TestClient

from hsx.api.app import create_app
from hsx.db import repository as repo
from hsx.manifest import load_manifest
from tests.support.api import problem, stored_rows
from tests.support.writer_stack import PER_SHARD, SAMPLE_BYTES, Stack


@pytest.fixture
def stack(tmp_path, database_url):
    made = Stack(tmp_path, database_url, flushers=3)
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


def create(api: TestClient, n: int, **options) -> str:
    body = {"samples": [{"id": f"s{i:03d}", "input_ids": list(range(1, 9))} for i in range(n)], "layers": [1, 2]}
    resp = api.post("/v1/jobs", json={**body, **options})
    assert resp.status_code == 202, resp.text
    return resp.json()["id"]


def test_shards_take_gap_free_numbers_in_the_order_recorded_and_the_feed_pages_them(stack, api):
    job_id = stack.job(8 * PER_SHARD)
    stack.extract(8 * PER_SHARD, tell=False)  # staged before the writer starts: three flushers race for them
    stack.start()
    stack.finished(job_id)
    with stack.sessions() as s:
        rows = sorted(repo.job_shards(s, job_id), key=lambda r: r.pk)
    assert [r.seq for r in rows] == list(range(1, 9))  # recorded order (pk) is feed order

    whole = feed(api, job_id)
    assert [s["seq"] for s in whole["data"]] == list(range(1, 9))
    assert whole["complete"] and whole["committed"] == 8 and whole["last_seq"] == 8 and not whole["has_more"]
    assert whole["header"]["layers"] == [1, 2] and whole["header"]["hidden_size"] == 64
    samples = [x["id"] for s in whole["data"] for x in s["samples"]]
    assert sorted(samples) == [f"s{i:03d}" for i in range(8 * PER_SHARD)]
    first = whole["data"][0]
    assert [x["offset"] for x in first["samples"]] == [i * 8 for i in range(PER_SHARD)]

    pages, after = [], 0
    while True:
        page = feed(api, job_id, after=after, limit=3)
        pages.append([s["seq"] for s in page["data"]])
        after = page["last_seq"]
        if page["complete"]:
            break
        assert page["has_more"]
    assert pages == [[1, 2, 3], [4, 5, 6], [7, 8]]
    assert feed(api, job_id, after=8)["data"] == [] and feed(api, job_id, after=8)["complete"]

    manifest = load_manifest(stack.settings.output_root / job_id)
    assert [(s.name, s.seq) for s in manifest.shards] == [(s["name"], s["seq"]) for s in whole["data"]]


def test_a_long_poll_answers_as_soon_as_a_shard_is_recorded(stack, api):
    job_id = stack.job(PER_SHARD)
    stack.start()
    assert feed(api, job_id, wait=0.2)["data"] == []  # nothing within its wait: an empty page, not complete
    answer: dict = {}

    def poll() -> None:
        started = time.monotonic()
        answer.update(feed(api, job_id, wait=30), took=time.monotonic() - started)

    follower = threading.Thread(target=poll)
    follower.start()
    time.sleep(0.5)
    stack.extract(PER_SHARD)  # a full shard: written at once
    follower.join(timeout=20)
    assert [s["seq"] for s in answer["data"]] == [1] and answer["took"] < 15
    assert answer["job_state"] in ("running", "succeeded")


def test_consumers_acknowledge_per_rank_and_retention_deletes_what_all_have_released(stack, api):
    job_id = create(api, 4 * PER_SHARD, consumers=["a", "b"], retention="acked")
    stack.start()
    stack.extract(4 * PER_SHARD)
    stack.finished(job_id)
    folder = stack.settings.output_root / job_id
    names = [s["name"] for s in feed(api, job_id)["data"]]

    resp = api.post(f"/v1/jobs/{job_id}/consumers", json={"name": "a"})
    assert resp.status_code == 200 and resp.json()["name"] == "a"  # registered at creation already
    metrics = api.get("/metrics").text
    assert f'hsx_consumer_lag_shards{{job="{job_id}",consumer="a"}} 4' in metrics
    assert f'hsx_job_unread_bytes{{job="{job_id}"}} {sum(s["bytes"] for s in feed(api, job_id)["data"])}' in metrics
    ack = {"rank": 0, "world_size": 2, "epoch": 1, "epochs": 1, "seq": 3}
    a = api.post(f"/v1/jobs/{job_id}/consumers/a/acks", json=ack).json()
    assert (a["read_seq"], a["world_size"], a["lag_shards"]) == (0, 2, 4)  # rank 1 has read nothing yet
    a = api.post(f"/v1/jobs/{job_id}/consumers/a/acks", json={**ack, "rank": 1, "seq": 2}).json()
    assert (a["read_seq"], a["released_seq"], a["lag_shards"]) == (2, 2, 2)
    assert all((folder / n).exists() for n in names)  # b has read nothing: nothing goes
    b = api.post(f"/v1/jobs/{job_id}/consumers/b/acks", json={"seq": 4}).json()
    assert b["read_seq"] == 4
    assert [(folder / n).exists() for n in names] == [False, False, True, True]
    shards = feed(api, job_id)["data"]
    assert [s["deleted"] for s in shards] == [True, True, False, False]
    body = problem(api.get(f"/v1/jobs/{job_id}/shards/{names[0]}"), 410)
    assert body["type"] == "/problems/shard-deleted" and body["deleted_shards"] == [names[0]]
    manifest = load_manifest(folder)  # written again: it says so too
    assert [s.deleted for s in manifest.shards] == [True, True, False, False]
    assert api.get(f"/v1/jobs/{job_id}/manifest").status_code == 200

    # an older position changes nothing; deleting consumer a releases what b has read
    a = api.post(f"/v1/jobs/{job_id}/consumers/a/acks", json={**ack, "seq": 1}).json()
    assert a["ranks"][0]["seq"] == 3
    assert api.delete(f"/v1/jobs/{job_id}/consumers/a").status_code == 204
    assert [(folder / n).exists() for n in names] == [False, False, False, False]
    assert [c["name"] for c in api.get(f"/v1/jobs/{job_id}/consumers").json()["data"]] == ["b"]


def test_an_acknowledgement_that_does_not_fit_is_refused(stack, api):
    job_id = create(api, PER_SHARD, consumers=["a"])
    stack.start()
    stack.extract(PER_SHARD)
    stack.finished(job_id)
    url = f"/v1/jobs/{job_id}/consumers"
    assert api.post(f"{url}/a/acks", json={"rank": 0, "world_size": 2, "seq": 1}).status_code == 200
    assert problem(api.post(f"{url}/a/acks", json={"rank": 0, "world_size": 3, "seq": 1}), 409)
    assert "world_size 2" in problem(api.post(f"{url}/a/acks", json={"world_size": 3, "seq": 1}), 409)["detail"]
    assert problem(api.post(f"{url}/a/acks", json={"seq": 2}), 422)["errors"][0]["field"] == "seq"
    for bad in ({"seq": -1}, {"rank": 2, "world_size": 2, "seq": 1}, {"epoch": 3, "epochs": 2, "seq": 1}, {}):
        problem(api.post(f"{url}/a/acks", json=bad), 422)
    problem(api.post(f"{url}/nobody/acks", json={"seq": 1}), 404)
    problem(api.post("/v1/jobs/job_nope/consumers", json={"name": "x"}), 404)
    problem(api.delete(f"{url}/nobody"), 404)
    problem(api.post(url, json={"name": ""}), 422)


def test_an_acknowledgement_in_a_later_epoch_counts_every_shard_read(stack, api):
    """Epoch 2 onwards a rank has read the whole feed once: its position compares past every shard's number,
    on either database (a sentinel wider than the column's type was refused by Postgres)."""
    job_id = create(api, PER_SHARD, consumers=["a"])
    stack.start()
    stack.extract(PER_SHARD)
    stack.finished(job_id)
    for epoch, epochs in ((2, 3), (2855, 2855)):
        a = api.post(f"/v1/jobs/{job_id}/consumers/a/acks", json={"epoch": epoch, "epochs": epochs, "seq": 0})
        assert a.status_code == 200, a.text
        assert (a.json()["read_seq"], a.json()["lag_shards"]) == (1, 0)


def test_max_unread_bytes_holds_extraction_back_until_the_consumers_read(stack, api):
    limit = 2 * PER_SHARD * SAMPLE_BYTES
    job_id = create(api, 6 * PER_SHARD, consumers=["slow"], max_unread_bytes=limit)
    stack.start()
    extracted = 0
    while extracted < 6 * PER_SHARD:
        with stack.sessions.begin() as s:
            claimed = repo.claim_next(s, stack.writer.identity)
        if claimed is None:
            break
        stack.stage(claimed)
        extracted += 1
    stack.wait(lambda: stack.state(job_id).unread_bytes >= limit)
    held = api.get(f"/v1/jobs/{job_id}").json()
    assert extracted < 6 * PER_SHARD and held["state"] == "running"
    assert held["waiting_reason"].startswith("waiting for consumers: ") and "unread by slow" in held["waiting_reason"]
    with stack.sessions.begin() as s:
        assert repo.claim_next(s, stack.writer.identity) is None

    last = feed(api, job_id)["last_seq"]
    api.post(f"/v1/jobs/{job_id}/consumers/slow/acks", json={"seq": last})
    with stack.sessions.begin() as s:
        claimed = repo.claim_next(s, stack.writer.identity)
    assert claimed is not None and claimed.job_id == job_id  # it goes on
    stack.stage(claimed)
    assert "consumers" not in (api.get(f"/v1/jobs/{job_id}").json()["waiting_reason"] or "")


def test_bad_feed_requests_and_options_are_refused_and_change_nothing(stack, api):
    job_id = create(api, 2)
    before = stored_rows(stack.settings.database_url)
    url = f"/v1/jobs/{job_id}/shards"
    for params in ({"wait": -1}, {"wait": 61}, {"after": -1}, {"limit": 0}, {"after": "x"}):
        problem(api.get(url, params=params), 422)
    assert problem(api.get(url, params={"after": 1}), 422)["errors"][0]["field"] == "after"
    problem(api.get("/v1/jobs/job_nope/shards"), 404)
    samples = [{"input_ids": [1, 2]}]
    for options in (
        {"retention": "acked"},
        {"max_unread_bytes": 10**12},
        {"consumers": ["a"], "max_unread_bytes": 1024},  # less than one shard
        {"consumers": ["a", "a"]},
        {"consumers": [""]},
        {"retention": "sometimes", "consumers": ["a"]},
    ):
        problem(api.post("/v1/jobs", json={"samples": samples, **options}), 422)
    ndjson = {"Content-Type": "application/x-ndjson"}
    problem(api.post("/v1/jobs", params={"retention": "acked"}, content=b'{"input_ids": [1]}\n', headers=ndjson), 422)
    assert stored_rows(stack.settings.database_url) == before
    resp = api.post(
        "/v1/jobs",
        params={"consumers": "a,b", "retention": "acked"},
        content=b'{"input_ids": [1]}\n',
        headers=ndjson,
    )
    assert resp.status_code == 202, resp.text
    made = resp.json()["id"]
    assert [c["name"] for c in api.get(f"/v1/jobs/{made}/consumers").json()["data"]] == ["a", "b"]

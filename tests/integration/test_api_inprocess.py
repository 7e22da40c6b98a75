"""The HTTP API in this process (FastAPI's TestClient over create_app, on a SQLite file, no writer):
creation, refusals that store nothing, lists and lookups, samples pages, cancel and delete, health.
The same answers the acceptance tests get from a served process, in a second."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from hsx.api.app import create_app
from hsx.config import Settings
from tests.support.api import api_only_settings, problem, stored_rows

OK = {"input_ids": [1, 2, 3]}
NDJSON = {"Content-Type": "application/x-ndjson"}


@pytest.fixture(scope="module")
def settings(tmp_path_factory) -> Settings:
    return api_only_settings(tmp_path_factory.mktemp("api"))


@pytest.fixture(scope="module")
def api(settings):
    with TestClient(create_app(settings)) as client:  # runs the lifespan: the cancel sweeper too
        yield client


@pytest.fixture
def unchanged(settings):
    """Asserts at the end of the test that it stored no job and no sample."""
    before = stored_rows(settings.database_url)
    yield
    assert stored_rows(settings.database_url) == before


def create(api: TestClient, body: dict) -> dict:
    resp = api.post("/v1/jobs", json=body)
    assert resp.status_code == 202, resp.text
    return resp.json()


def wait_state(api: TestClient, job_id: str, state: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while (job := api.get(f"/v1/jobs/{job_id}").json())["state"] != state:
        assert time.monotonic() < deadline, f"job {job_id} still {job['state']}, not {state}"
        time.sleep(0.02)
    return job


def test_healthz_says_the_database_answers(api):
    resp = api.get("/healthz")
    assert resp.status_code == 200
    assert resp.json() == {"status": "ok", "database": "ok", "writer": None, "writers": [], "warnings": []}
    assert api.head("/healthz").status_code == 200


def test_a_created_job_is_202_with_its_location_and_stored_queued(api, settings):
    before = stored_rows(settings.database_url)
    body = {"name": "demo", "samples": [{"id": "a", **OK}, {"id": "b", "input_ids": [4, 5], "loss_mask": [0, 1]}]}
    resp = api.post("/v1/jobs", json=body)
    assert resp.status_code == 202, resp.text
    job = resp.json()
    assert resp.headers["location"] == f"/v1/jobs/{job['id']}"
    assert (job["object"], job["name"], job["state"], job["layers"]) == ("job", "demo", "queued", "eagle3")
    assert job["counts"] == {
        "total": 2,
        "preparing": 0,
        "queued": 2,
        "running": 0,
        "staged": 0,
        "succeeded": 0,
        "failed": 0,
        "cancelled": 0,
        "skipped": 0,
        "truncated": 0,
    }
    assert job["tokens"] == {"total": 5, "done": 0, "staged": 0}
    assert job["manifest_url"] == f"/v1/jobs/{job['id']}/manifest"
    assert stored_rows(settings.database_url) == (before[0] + 1, before[1] + 2)
    again = api.get(resp.headers["location"]).json()
    assert again["waiting_reason"].startswith("no writer is running")  # none here: it waits, and says why
    clock = {"elapsed_s": None}  # moves with the clock alone (hsx.wire.CLOCK_FIELDS)
    assert again | {"waiting_reason": None} | clock == job | clock and again["elapsed_s"] >= job["elapsed_s"]


def test_a_streamed_job_is_created_alike(api):
    lines = b"".join(json.dumps({"id": f"s{i}", "input_ids": [i + 1] * (i + 1)}).encode() + b"\n" for i in range(3))
    resp = api.post("/v1/jobs", params={"name": "streamed", "layers": "2,5"}, content=lines, headers=NDJSON)
    assert resp.status_code == 202, resp.text
    job = resp.json()
    assert resp.headers["location"] == f"/v1/jobs/{job['id']}"
    assert (job["name"], job["layers"], job["counts"]["total"], job["tokens"]["total"]) == ("streamed", [2, 5], 3, 6)


@pytest.mark.parametrize(
    "body,index,field",
    [
        ({"samples": []}, None, "samples"),
        ({"samples": [OK, {"input_ids": []}]}, 1, "input_ids"),
        ({"samples": [{"input_ids": [1, "2"]}]}, 0, "input_ids.1"),
        ({"samples": [{"input_ids": [1, 2], "loss_mask": [1]}]}, 0, "loss_mask"),
        ({"samples": [{"id": "a", **OK}, {"id": "a", **OK}]}, 1, "id"),
        ({"samples": [OK], "input_path": "x.jsonl"}, None, "body"),
        ({"samples": [OK], "layers": [5, 2]}, None, "layers"),
    ],
)
def test_bad_input_is_a_422_problem_that_stores_nothing(api, unchanged, body, index, field):
    errors = problem(api.post("/v1/jobs", json=body), 422)["errors"]
    assert errors[0].get("sample_index") == index, errors
    assert errors[0]["field"].startswith(field), errors


SETS = "eagle3, eagle3_pre_norm, dflash, dflash_pre_norm, last, last_pre_norm"


@pytest.mark.parametrize(
    "layers",
    [[], "eagle4", ["eagle3", "dflsh"], ["eagle3", "eagle3_pre_norm"], ["any", "eagle3"]],
    ids=["empty", "unknown", "unknown-in-a-list", "both-sides-of-the-norm", "any-in-a-list"],
)
def test_bad_layers_are_a_422_naming_the_sets(api, unchanged, layers):
    errors = problem(api.post("/v1/jobs", json={"samples": [OK], "layers": layers}), 422)["errors"]
    assert errors[0]["field"] == "layers" and (
        SETS in errors[0]["message"] or "eagle3 and dflash" in errors[0]["message"]
    )


def test_several_layer_sets_are_one_job_shown_as_asked(api):
    job = create(api, {"samples": [OK], "layers": ["dflash", "eagle3", 7]})
    assert job["layers"] == ["eagle3", "dflash", 7]
    streamed = api.post("/v1/jobs", params={"layers": "eagle3,dflash"}, content=b'{"input_ids": [1]}\n', headers=NDJSON)
    assert streamed.status_code == 202 and streamed.json()["layers"] == ["eagle3", "dflash"]
    bad = api.post("/v1/jobs", params={"layers": "eagle3,nope"}, content=b'{"input_ids": [1]}\n', headers=NDJSON)
    assert SETS in problem(bad, 422)["errors"][0]["message"]


def test_bad_bodies_of_every_kind_store_nothing(api, unchanged):
    assert problem(api.post("/v1/jobs", content=b"{", headers={"Content-Type": "application/json"}), 422)
    streamed = b'{"input_ids": [1]}\n{"input_ids": "x"}\n'
    errors = problem(api.post("/v1/jobs", content=streamed, headers=NDJSON), 422)["errors"]
    assert (errors[0]["line"], errors[0]["sample_index"]) == (2, 1)
    assert problem(api.post("/v1/jobs", content=b"a", headers={"Content-Type": "text/plain"}), 415)
    assert problem(api.post("/v1/jobs", params={"layers": "5,2"}, content=streamed, headers=NDJSON), 422)


def test_jobs_list_newest_first_page_by_page(api):
    ids = [create(api, {"name": f"list-{i}", "samples": [OK]})["id"] for i in range(3)]
    first = api.get("/v1/jobs", params={"limit": 2}).json()
    assert (first["object"], first["has_more"], len(first["data"])) == ("list", True, 2)
    assert [j["id"] for j in first["data"]] == ids[:0:-1]
    assert first["next_after"] == ids[1]
    rest = api.get("/v1/jobs", params={"after": first["next_after"], "limit": 1000}).json()
    assert rest["data"][0]["id"] == ids[0] and not rest["has_more"] and rest["next_after"] is None
    queued = api.get("/v1/jobs", params={"state": "queued", "limit": 1000}).json()["data"]
    assert set(ids) <= {j["id"] for j in queued} and {j["state"] for j in queued} == {"queued"}
    assert problem(api.get("/v1/jobs", params={"state": "sleeping"}), 422)
    assert problem(api.get("/v1/jobs", params={"limit": 0}), 422)


def test_unknown_jobs_and_samples_are_404_problems(api):
    job = create(api, {"samples": [OK]})
    assert problem(api.get("/v1/jobs/job_0000000000000000000"), 404)["detail"]
    assert problem(api.get(f"/v1/jobs/{job['id']}/samples/nope"), 404)
    assert problem(api.get("/v1/jobs/job_0000000000000000000/samples"), 404)
    assert problem(api.post("/v1/jobs/job_0000000000000000000/cancel"), 404)
    assert problem(api.delete("/v1/jobs/job_0000000000000000000"), 404)


def test_samples_come_in_input_order_page_by_page(api):
    job = create(api, {"samples": [{"input_ids": [1] * (i + 1)} for i in range(5)]})
    path = f"/v1/jobs/{job['id']}/samples"
    first = api.get(path, params={"limit": 2}).json()
    assert [(s["id"], s["index"], s["expected_tokens"]) for s in first["data"]] == [("0", 0, 1), ("1", 1, 2)]
    assert first["has_more"] and first["next_after"] == "1"
    rest = api.get(path, params={"after": "1"}).json()
    assert [s["id"] for s in rest["data"]] == ["2", "3", "4"] and not rest["has_more"]
    assert api.get(path, params={"after": ""}).json() == api.get(path).json()  # an empty cursor: the first page
    assert [s["state"] for s in api.get(path, params={"state": "queued"}).json()["data"]] == ["queued"] * 5
    assert api.get(path, params={"state": "failed"}).json()["data"] == []
    assert problem(api.get(path, params={"after": "nope"}), 422)["errors"][0]["field"] == "after"
    sample = api.get(f"{path}/3").json()
    assert (sample["id"], sample["state"], sample["attempts"], sample["attempt_log"]) == ("3", "queued", 0, [])


def test_a_cancelled_job_ends_cancelled_and_can_then_be_deleted(api, settings):
    job = create(api, {"samples": [OK, OK | {"id": "x"}]})
    path = f"/v1/jobs/{job['id']}"
    assert problem(api.delete(path), 409)  # not finished
    cancelling = api.post(f"{path}/cancel")
    assert cancelling.status_code == 200, cancelling.text
    assert cancelling.json()["state"] in ("cancelling", "cancelled") and cancelling.json()["cancel_requested_at"]
    ended = wait_state(api, job["id"], "cancelled")  # the sweeper this process runs, woken by the cancel
    assert ended["counts"]["cancelled"] == 2 and ended["counts"]["queued"] == 0 and ended["finished_at"]
    assert api.post(f"{path}/cancel").status_code == 409
    assert api.get(f"{path}/manifest").json()["job_id"] == job["id"]
    before = stored_rows(settings.database_url)
    assert api.delete(path, params={"delete_files": "true"}).status_code == 204
    assert stored_rows(settings.database_url) == (before[0] - 1, before[1] - 2)
    assert problem(api.get(path), 404)
    assert not (settings.output_root / job["id"]).exists()


def deleted_without_files(api: TestClient) -> str:
    """A cancelled job (its manifest written) whose records were deleted without its files; its id."""
    job = create(api, {"samples": [OK]})
    api.post(f"/v1/jobs/{job['id']}/cancel")
    wait_state(api, job["id"], "cancelled")
    assert api.delete(f"/v1/jobs/{job['id']}").status_code == 204
    return job["id"]


def test_the_files_a_delete_left_are_deleted_by_a_later_delete_with_files(api, settings):
    job_id = deleted_without_files(api)
    folder = settings.output_root / job_id
    assert (folder / "manifest.json").is_file(), "without delete_files the folder stays"
    assert problem(api.delete(f"/v1/jobs/{job_id}"), 404), "no records, and no files asked for"
    (folder / ".unnumbered-0123456789abcdef.tmp-42").write_bytes(b"what a crash left")
    assert api.delete(f"/v1/jobs/{job_id}", params={"delete_files": "true"}).status_code == 204
    assert not folder.exists()
    assert problem(api.delete(f"/v1/jobs/{job_id}", params={"delete_files": "true"}), 404)


def test_a_left_folder_is_removed_only_when_it_is_plainly_hsxs(api, settings):
    job_id = deleted_without_files(api)
    folder = settings.output_root / job_id
    (folder / "notes.txt").write_text("mine")
    refused = problem(api.delete(f"/v1/jobs/{job_id}", params={"delete_files": "true"}), 409)
    assert (refused["type"], refused["foreign_files"]) == ("/problems/foreign-files", ["notes.txt"])
    assert sorted(p.name for p in folder.iterdir()) == ["manifest.json", "notes.txt"], "nothing removed"
    (folder / "notes.txt").unlink()
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps(manifest | {"job_id": "job_00000000000000000000"}))
    assert problem(api.delete(f"/v1/jobs/{job_id}", params={"delete_files": "true"}), 409)["foreign_files"] == [
        "manifest.json"
    ], "another job's manifest"
    # Not a job folder's name, or not a folder: nothing is touched.
    other = settings.output_root / "kept"
    other.mkdir()
    (other / "manifest.json").write_text("{}")
    link = settings.output_root / "job_0123456789abcdef0123"
    link.symlink_to(other)
    for name in ("kept", link.name, "..", "job_0123456789abcdef0123/..", "%2E%2E"):
        assert api.delete(f"/v1/jobs/{name}", params={"delete_files": "true"}).status_code in (404, 405), name
    assert (other / "manifest.json").exists() and link.is_symlink() and folder.exists()


def test_metrics_and_workers_read_the_database(api):
    create(api, {"samples": [OK]})
    metrics = api.get("/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert 'hsx_jobs{state="queued"}' in metrics.text and 'hsx_samples{state="queued"}' in metrics.text
    assert api.get("/v1/workers").json() == {"object": "list", "data": []}

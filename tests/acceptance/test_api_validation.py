"""Bad input gets a clear problem+json error naming the sample and field, and stores nothing."""

from __future__ import annotations

import json
import os

import pytest

from tests.support.api import problem, stored_rows
from tests.support.stack import start_service

OK = {"input_ids": [1, 2, 3]}


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def service(request, tmp_path_factory):
    """One API-only service per database for the whole module (no writer: nothing gets processed)."""
    tmp = tmp_path_factory.mktemp(f"api-{request.param}")
    if request.param == "sqlite":
        url = f"sqlite:///{tmp / 'hsx.db'}"
    else:
        url = request.getfixturevalue("postgres_module_url")
    svc = start_service(tmp, url, extra=["--no-writer"])
    yield svc
    svc.stop()


@pytest.fixture
def unchanged(service):
    """Asserts at the end of the test that no job or sample was stored by it."""
    before = stored_rows(service.database_url)
    yield
    assert stored_rows(service.database_url) == before


BAD_BODIES = [
    ({"samples": []}, None, "samples"),
    ({"samples": [OK, {"input_ids": []}]}, 1, "input_ids"),
    ({"samples": [OK, {"input_ids": [1, 2.5]}]}, 1, "input_ids.1"),
    ({"samples": [{"input_ids": [1, "2"]}]}, 0, "input_ids.1"),
    ({"samples": [{"input_ids": [1, True]}]}, 0, "input_ids.1"),
    ({"samples": [OK, OK, {"input_ids": [4, -1]}]}, 2, "input_ids.1"),
    ({"samples": [{"input_ids": [1, 2], "loss_mask": [1]}]}, 0, "loss_mask"),
    ({"samples": [{"input_ids": [1, 2], "loss_mask": [1, 2]}]}, 0, "loss_mask"),
    ({"samples": [{"id": "a", **OK}, {"id": "a", **OK}]}, 1, "id"),
    ({"samples": [{"id": 7, **OK}, {"id": "7", **OK}]}, 1, "id"),
    ({"samples": [{**OK, "colour": "blue"}]}, 0, "colour"),
    ({"samples": [OK], "input_path": "x.jsonl"}, None, "body"),
    ({}, None, "body"),
    ({"samples": [OK], "layers": [5, 2]}, None, "layers"),
]


@pytest.mark.parametrize("body,index,field", BAD_BODIES)
def test_bad_job_is_refused_and_nothing_stored(service, unchanged, body, index, field):
    body_out = problem(service.post_job(body), 422)
    errors = body_out.get("errors") or [{"field": body_out.get("field")}]
    first = errors[0]
    assert first.get("sample_index") == index, errors
    assert first["field"] == field or first["field"].startswith(field), errors


def test_not_json_is_a_problem(service, unchanged):
    resp = service.client.post(service.url + "/v1/jobs", content=b"{nope", headers={"content-type": "application/json"})
    problem(resp, 422)


def test_input_path_must_stay_under_the_input_root(service, unchanged, tmp_path):
    outside = tmp_path / "outside.jsonl"
    outside.write_text(json.dumps(OK) + "\n")
    link = service.input_root / "link.jsonl"
    link.unlink(missing_ok=True)
    os.symlink(outside, link)
    for path in ["../outside.jsonl", str(outside), "link.jsonl", "sub/../../outside.jsonl"]:
        body = problem(service.post_job({"input_path": path}), 403)
        assert body["field"] == "input_path"
    problem(service.post_job({"input_path": "missing.jsonl"}), 422)


def test_jsonl_errors_name_the_line(service, unchanged):
    (service.input_root / "bad.jsonl").write_text(
        json.dumps(OK) + "\n\n" + json.dumps({"input_ids": [1, 2], "loss_mask": [0]}) + "\n{broken\n"
    )
    body = problem(service.post_job({"input_path": "bad.jsonl"}), 422)
    assert [(e["sample_index"], e["line"], e["field"]) for e in body["errors"]] == [
        (1, 3, "loss_mask"),
        (2, 4, "sample"),
    ]


def test_jsonl_input_creates_the_job(service):
    jobs_before, samples_before = stored_rows(service.database_url)
    lines = [{"id": f"r{i}", "input_ids": list(range(1, i + 2))} for i in range(5)]
    (service.input_root / "good.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    resp = service.post_job({"input_path": "good.jsonl", "name": "from-file"})
    assert resp.status_code == 202, resp.text
    job = resp.json()
    assert job["counts"]["total"] == 5 and job["tokens"]["total"] == 15 and job["state"] == "queued"
    assert stored_rows(service.database_url) == (jobs_before + 1, samples_before + 5)
    samples = service.get(f"/v1/jobs/{job['id']}/samples").json()["data"]
    assert [s["id"] for s in samples] == [f"r{i}" for i in range(5)]
    assert all(s["state"] == "queued" for s in samples)


def test_unknown_things_are_404_problems(service):
    problem(service.get("/v1/jobs/job_nope"), 404)
    job = service.post_job({"samples": [OK]}).json()
    problem(service.get(f"/v1/jobs/{job['id']}/samples/nope"), 404)
    problem(service.get(f"/v1/jobs/{job['id']}/shards/shard-000000.safetensors"), 404)
    problem(service.get(f"/v1/jobs/{job['id']}/shards/..%2F..%2Fhsx.db"), 404)
    problem(service.get(f"/v1/jobs/{job['id']}/samples", params={"after": "nope"}), 422)
    problem(service.get(f"/v1/jobs/{job['id']}/samples", params={"state": "weird"}), 422)

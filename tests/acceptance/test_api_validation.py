"""Bad input gets a clear problem+json error naming the sample and field, and stores nothing."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from hsx.names import MAX_LENGTH
from hsx.sdk import HsxClient, HsxError
from tests.support.api import problem, stored_rows
from tests.support.stack import start_service

OK = {"input_ids": [1, 2, 3]}


@pytest.fixture(scope="module")
def service(api_only):
    """The module's API-only service (tests/acceptance/conftest.py), one per database."""
    return api_only


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
    ({"samples": [OK], "layers": [2, 2, 5]}, None, "layers"),
    ({"samples": [OK], "layers": [2, 5, 5]}, None, "layers"),
]


@pytest.mark.parametrize("body,index,field", BAD_BODIES)
def test_bad_job_is_refused_and_nothing_stored(service, unchanged, body, index, field):
    body_out = problem(service.post_job(body), 422)
    errors = body_out.get("errors") or [{"field": body_out.get("field")}]
    first = errors[0]
    assert first.get("sample_index") == index, errors
    assert first["field"] == field or first["field"].startswith(field), errors


@pytest.mark.parametrize("layers", ["2,2,5", "5,2", "2,5,5"])
def test_streamed_job_asking_for_a_layer_twice_or_out_of_order_is_refused(service, unchanged, layers):
    resp = service.client.post(
        service.url + "/v1/jobs",
        params={"layers": layers},
        content=json.dumps(OK).encode() + b"\n",
        headers={"content-type": "application/x-ndjson"},
    )
    body = problem(resp, 422)
    assert body["errors"][0]["field"] == "layers" and "unique, ascending" in body["errors"][0]["message"]


@pytest.mark.parametrize(
    "query, field, words",
    [
        ("encodng=fp8", "query.encodng", "did you mean encoding?"),
        ("encoding=fp8&encoding=raw", "query.encoding", "given 2 times"),
        ("name=a&name=b", "query.name", "given 2 times"),
        ("layers=2,4&layers=2,4", "query.layers", "given 2 times"),
        ("layers=2,,4", "layers", "an empty item"),
        ("layers=2,4,", "layers", "an empty item"),
        ("layers=2,%204", "layers", "' 4', which is not a layer number"),
        ("max_length=8&max_length=9&lenght_policy=skip", "query.max_length", "given 2 times"),
    ],
)
def test_a_streamed_jobs_query_is_as_strict_as_a_json_body(service, unchanged, query, field, words):
    """An unknown or repeated parameter, or a layer list with an empty item, is a 422 naming it: never a job
    made with defaults, the last value, or the layers that remain."""
    resp = service.client.post(
        f"{service.url}/v1/jobs?{query}",
        content=json.dumps(OK).encode() + b"\n",
        headers={"content-type": "application/x-ndjson"},
    )
    errors = problem(resp, 422)["errors"]
    assert errors[0]["field"] == field and words in errors[0]["message"], errors


def test_a_json_bodys_query_is_checked_alike(service, unchanged):
    """With a JSON body too, a parameter a job creation does not take, or one given twice, is refused."""
    for query, field in (("encodng=fp8", "query.encodng"), ("name=a&name=b", "query.name")):
        resp = service.client.post(f"{service.url}/v1/jobs?{query}", json={"samples": [OK]})
        assert problem(resp, 422)["errors"][0]["field"] == field


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


# --- ids and names: one length limit, one character rule, on both databases -----------------------

LONGEST = "x" * MAX_LENGTH
TOO_LONG = "x" * (MAX_LENGTH + 1)


def first_error(body: dict) -> dict:
    return (body.get("errors") or [{"field": body.get("field")}])[0]


@pytest.mark.parametrize(
    "body,field,words",
    [
        ({"samples": [OK, {"id": TOO_LONG, **OK}]}, "id", "201 characters"),
        ({"samples": [{"id": "a\x00b", **OK}]}, "id", "NUL"),
        ({"samples": [{"id": "line\nbreak", **OK}]}, "id", "U+000A"),
        ({"samples": [{"id": "", **OK}]}, "id", "empty"),
        ({"samples": [{"id": 2**64, **OK}]}, "id", "64 bits"),
        ({"samples": [{"id": 1.5, **OK}]}, "id", "string or an integer"),
        ({"name": TOO_LONG, "samples": [OK]}, "name", "at most 200"),
        ({"name": "night\x00ly", "samples": [OK]}, "name", "NUL"),
        ({"name": "tab\t", "samples": [OK]}, "name", "U+0009"),
        ({"input_path": "in\x00put.jsonl"}, "input_path", "NUL"),
        ({"input_path": "a" * 5000}, "input_path", "at most 4096"),
    ],
)
def test_ids_and_names_past_the_limits_are_refused(service, unchanged, body, field, words):
    err = first_error(problem(service.post_job(body), 422))
    assert err["field"] == field and words in err["message"], err


def test_lone_surrogates_are_invalid_json(service, unchanged):
    for raw in (b'{"samples": [{"id": "a\\ud800", "input_ids": [1]}]}', b'{"name": "\\udc00", "samples": []}'):
        resp = service.client.post(service.url + "/v1/jobs", content=raw, headers={"content-type": "application/json"})
        assert "Invalid JSON" in problem(resp, 422)["detail"]


def ndjson(service, body: bytes, **params) -> dict:
    resp = service.client.post(
        service.url + "/v1/jobs", content=body, params=params, headers={"content-type": "application/x-ndjson"}
    )
    return problem(resp, 422)


def test_streamed_and_file_samples_follow_the_same_limits(service, unchanged):
    lines = [OK, {"id": TOO_LONG, **OK}, {"id": "nul\x00", **OK}]
    text = "".join(json.dumps(x) + "\n" for x in lines)
    (service.input_root / "limits.jsonl").write_text(text)
    for body in (ndjson(service, text.encode()), problem(service.post_job({"input_path": "limits.jsonl"}), 422)):
        assert [(e["line"], e["field"]) for e in body["errors"]] == [(2, "id"), (3, "id")]
        assert "201 characters" in body["errors"][0]["message"] and "NUL" in body["errors"][1]["message"]
    surrogate = ndjson(service, b'{"id": "\\ud800x", "input_ids": [1]}\n')
    assert surrogate["errors"][0]["line"] == 1 and "Invalid JSON" in surrogate["errors"][0]["message"]
    for name, words in ((TOO_LONG, "at most 200"), ("a\x00", "NUL")):
        err = first_error(ndjson(service, (json.dumps(OK) + "\n").encode(), name=name))
        assert err["field"] == "query.name" and words in err["message"], err


def test_ids_at_the_limits_are_stored_and_addressable(service):
    """Whatever creation accepts, paths and cursors reach: the longest ids (in characters, Postgres's
    measure), unicode, blanks, slashes, dot segments, URL syntax, integers."""
    ids = [
        LONGEST,
        "\U0001f600" * MAX_LENGTH,
        "é ✓ 中文",
        "  spaced out  ",
        "conv/7/turn 2",
        "/leading",
        "trailing/",
        "a//b",
        ".",
        "..",
        "a/../b",
        "./x",
        "?q=1&r#frag",
        "100%",
        "line\u2028separator\u00a0nbsp",
        "-9223372036854775808",
    ]
    samples = [{"id": sid, **OK} for sid in ids] + [{"id": 2**63 - 1, **OK}]
    created = service.post_job({"name": "\U0001f600" * MAX_LENGTH, "samples": samples})
    assert created.status_code == 202, created.text
    job = created.json()
    assert job["name"] == "\U0001f600" * MAX_LENGTH
    with HsxClient(service.url) as client:
        for sid in ids + [str(2**63 - 1)]:
            assert client.get_sample(job["id"], sid).id == sid
            # Not extracted (no writer): the 409 names the sample the path reached.
            with pytest.raises(HsxError) as exc:
                client.sample_tensors(job["id"], sid)
            assert exc.value.status == 409 and repr(sid) in exc.value.detail
        seen, after = [], None
        while True:
            page = client.list_samples(job["id"], after=after, limit=3)
            seen += [s.id for s in page.data]
            if not page.has_more:
                break
            after = page.next_after
        assert seen == ids + [str(2**63 - 1)]


def test_path_values_no_id_can_hold(service):
    """Too long: unknown (404), no query sent. NUL: a 422 naming the parameter, never a database error."""
    job = service.post_job({"samples": [{"id": "a", **OK}]}).json()["id"]
    base = f"/v1/jobs/{job}"
    before = stored_rows(service)
    long_paths = [
        "/v1/jobs/" + TOO_LONG,
        "/v1/jobs/" + "j" * 5000,
        f"/v1/jobs/{TOO_LONG}/samples",
        f"{base}/samples/{TOO_LONG}",
        f"{base}/tensors/{TOO_LONG}",
        f"{base}/shards/{TOO_LONG}",
    ]
    for path in long_paths:
        assert problem(service.get(path), 404)["detail"].endswith("characters) not found"), path[:60]
    nul = {
        ("GET", "/v1/jobs/a%00b"): "path.job_id",
        ("GET", "/v1/jobs/a%00b/events"): "path.job_id",
        ("GET", "/v1/jobs/a%00b/samples"): "path.job_id",
        ("GET", "/v1/jobs/a%00b/manifest"): "path.job_id",
        ("POST", "/v1/jobs/a%00b/cancel"): "path.job_id",
        ("POST", "/v1/jobs/a%00b/retry"): "path.job_id",
        ("POST", "/v1/jobs/a%00b/verify"): "path.job_id",
        ("DELETE", "/v1/jobs/a%00b"): "path.job_id",
        ("GET", f"{base}/samples/a%00"): "path.sample_id",
        ("GET", f"{base}/tensors/a%00"): "path.sample_id",
        ("GET", f"{base}/shards/a%00.safetensors"): "path.name",
    }
    for (method, path), field in nul.items():
        err = first_error(problem(service.client.request(method, service.url + path), 422))
        assert err["field"] == field and "NUL" in err["message"], (path, err)
    assert service.get(f"{base}/samples/a").status_code == 200  # the connection and the job are fine
    assert stored_rows(service) == before


def test_query_values_no_id_can_hold(service):
    job = service.post_job({"samples": [{"id": "a", **OK}]}).json()["id"]
    cases = [
        ("/v1/jobs", {"after": "job_\x00"}, "query.after", "NUL"),
        ("/v1/jobs", {"after": TOO_LONG}, "query.after", "at most 200"),
        ("/v1/jobs", {"state": "queued\x00"}, "query.state", "queued"),
        ("/v1/jobs", {"limit": "0"}, "query.limit", "greater than or equal to 1"),
        ("/v1/jobs", {"limit": "1001"}, "query.limit", "less than or equal to 1000"),
        ("/v1/jobs", {"limit": "9" * 30}, "query.limit", "less than or equal to 1000"),
        (f"/v1/jobs/{job}/samples", {"after": "a\x00"}, "query.after", "NUL"),
        (f"/v1/jobs/{job}/samples", {"after": TOO_LONG}, "query.after", "at most 200"),
        (f"/v1/jobs/{job}/samples", {"state": "\x00"}, "query.state", "queued"),
        (f"/v1/jobs/{job}/samples", {"limit": "-1"}, "query.limit", "greater than or equal to 1"),
    ]
    for path, params, field, words in cases:
        err = first_error(problem(service.get(path, params=params), 422))
        assert err["field"] == field and words in err["message"], (params, err)
    # A job cursor is a job id (ids sort by creation): text of the allowed length that is not one is refused
    # as the samples list refuses a sample id the job does not have.
    assert first_error(problem(service.get("/v1/jobs", params={"after": LONGEST}), 422))["field"] == "after"
    assert service.get("/v1/jobs", params={"after": "job_" + "f" * 20}).status_code == 200


def test_input_paths_the_file_system_cannot_follow(service, unchanged):
    loop = service.input_root / "loop"
    for link, target in ((loop / "a", "b"), (loop / "b", "a")):
        loop.mkdir(exist_ok=True)
        link.unlink(missing_ok=True)
        os.symlink(target, link)
    (service.input_root / "folder").mkdir(exist_ok=True)
    cases = {
        "loop/a": "loop",
        "loop/a/samples.jsonl": "loop",
        "n" * 300 + ".jsonl": "longer than the file system allows",
        "d/" * 2044 + "x.jsonl": "longer than the file system allows",
        "folder": "no file",
    }
    for path, words in cases.items():
        err = first_error(problem(service.post_job({"input_path": path}), 422))
        assert err["field"] == "input_path" and words in err["message"], (path[:20], err)


def test_integers_written_with_a_zero_fraction_are_integers(service):
    # JSON Schema's "integer", which the OpenAPI document says these are, includes 3.0.
    resp = service.post_job({"samples": [{"id": 7.0, "input_ids": [1.0, 2], "loss_mask": [1.0, 0]}], "layers": [2.0]})
    assert resp.status_code == 202, resp.text
    job = resp.json()
    assert job["layers"] == [2] and job["tokens"]["total"] == 2
    assert [s["id"] for s in service.get(f"/v1/jobs/{job['id']}/samples").json()["data"]] == ["7"]
    line = b'{"id": "n", "input_ids": [5.0, 6]}\n'
    resp = service.client.post(service.url + "/v1/jobs", content=line, headers={"content-type": "application/x-ndjson"})
    assert resp.status_code == 202, resp.text


@pytest.mark.parametrize(
    "body",
    [
        {"samples": [{"input_ids": ["a"] * 200_000}]},
        {"samples": [{"input_ids": [1] * 100_000, "loss_mask": [0.5] * 100_000}]},
        {"samples": [OK], "layers": [1.5] * 200_000},
    ],
    ids=["input_ids", "loss_mask", "layers"],
)
def test_a_huge_mistyped_list_is_one_error_not_one_per_element(service, unchanged, body):
    errors = problem(service.post_job(body), 422)["errors"]
    assert len(errors) == 1, errors[:3]


def test_layers_are_bounded_alike_on_every_database(service, unchanged):
    """A layers key longer than the database's column used to be a 500 on Postgres and stored on SQLite."""
    body = problem(service.post_job({"samples": [OK], "layers": list(range(257))}), 422)
    assert body["errors"][0]["field"] == "layers"
    body = problem(service.post_job({"samples": [OK], "layers": [1, 4096]}), 422)
    assert "at most 4095" in body["errors"][0]["message"]


def test_the_most_layers_allowed_are_stored_on_every_database(service):
    layers = list(range(4095 - 255, 4096))
    resp = service.post_job({"samples": [OK], "layers": layers})
    assert resp.status_code == 202, resp.text
    assert resp.json()["layers"] == layers


def test_stalled_uploads_time_out_and_free_their_slots(tmp_path, database_url):
    """Two uploads that announce a large body and stop sending: each is answered 408 once nothing has
    arrived for --body-idle-timeout-s, and a large job creation is taken in again after them."""
    svc = start_service(
        tmp_path,
        database_url,
        extra=["--no-writer", "--max-large-bodies", "2", "--large-body-bytes", "1000", "--body-idle-timeout-s", "1"],
    )
    stalled = []
    try:
        host, port = svc.url.removeprefix("http://").split(":")
        for _ in range(2):
            s = socket.create_connection((host, int(port)), timeout=30)
            s.sendall(
                b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 9000000\r\n\r\n" + b'{"samples": [' + b" " * 5000
            )
            stalled.append(s)
        time.sleep(0.3)
        big = {"samples": [{"input_ids": list(range(1, 400))}]}
        assert svc.post_job(big).status_code == 503, "both large-body slots are held"
        for s in stalled:
            answer = b""
            while chunk := s.recv(65536):  # the service closes the connection after its answer
                answer += chunk
            answer = answer.decode(errors="replace")
            assert answer.startswith("HTTP/1.1 408"), answer[:300]
            assert "stopped arriving" in answer
        assert svc.post_job(big).status_code == 202, "the slots are free again"
    finally:
        for s in stalled:
            s.close()
        svc.stop()


def test_an_empty_cursor_is_the_first_page(service):
    job = service.post_job({"samples": [OK, OK]}).json()
    for path in (f"/v1/jobs/{job['id']}/samples?after=", "/v1/jobs?after="):
        resp = service.get(path)
        assert resp.status_code == 200 and resp.json()["data"], (path, resp.text)


def test_a_query_value_that_is_not_utf8_is_refused_not_replaced(service, unchanged):
    line = json.dumps(OK).encode() + b"\n"
    resp = service.client.post(
        service.url + "/v1/jobs?name=%FFbad", content=line, headers={"content-type": "application/x-ndjson"}
    )
    assert problem(resp, 422)["errors"][0]["field"] == "name"

"""HTTP at its edges, on both databases. Request bodies at and past the service's limits: refused early
with the right problem and nothing stored; large ones taken in a few at a time while the rest of the
API keeps answering; repeated submissions with one Idempotency-Key, however many at once, get one job.
HEAD, 405 and redirects. (Shard downloads' Range and If-None-Match: test_api_lifecycle.py.)"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.api import RawUpload, problem, stored_rows
from tests.support.stack import start_service

SAMPLE_LIMIT = 4096
JSON_LIMIT = 300_000
NDJSON_LIMIT = 2_000_000
LARGE = 50_000
NDJSON = {"content-type": "application/x-ndjson"}


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def service(request, tmp_path_factory):
    """An API-only service (no writer) with small limits, one large body at a time."""
    tmp = tmp_path_factory.mktemp(f"bodies-{request.param}")
    url = f"sqlite:///{tmp / 'hsx.db'}" if request.param == "sqlite" else request.getfixturevalue("postgres_module_url")
    flags = {
        "--max-json-bytes": JSON_LIMIT,
        "--max-ndjson-bytes": NDJSON_LIMIT,
        "--max-sample-bytes": SAMPLE_LIMIT,
        "--large-body-bytes": LARGE,
        "--max-large-bodies": 1,
    }
    svc = start_service(tmp, url, extra=["--no-writer", *(str(x) for kv in flags.items() for x in kv)])
    yield svc
    svc.stop()


def lines(n: int, seed: int = 0, width: int = 3) -> bytes:
    return b"".join(
        json.dumps({"id": f"s{seed}-{i}", "input_ids": [(seed + i + k) % 300 for k in range(width)]}).encode() + b"\n"
        for i in range(n)
    )


def test_an_ndjson_line_over_the_limit_is_413_naming_the_line(service, unchanged):
    long = json.dumps({"input_ids": [1] * (SAMPLE_LIMIT // 2)}).encode()
    body = lines(2) + b"\n" + long + b"\n" + lines(2, seed=1)
    out = problem(service.client.post(service.url + "/v1/jobs", content=body, headers=NDJSON), 413)
    assert out["line"] == 4 and out["limit_bytes"] == SAMPLE_LIMIT
    assert "line 4" in out["detail"] and "--max-sample-bytes" in out["detail"]
    # The same line at the end of a body without a final newline.
    out = problem(service.client.post(service.url + "/v1/jobs", content=lines(1) + long, headers=NDJSON), 413)
    assert out["line"] == 2


def test_an_inline_sample_over_the_limit_is_413_naming_it(service, unchanged):
    samples = [{"input_ids": [1]}, {"input_ids": [2] * SAMPLE_LIMIT}, {"input_ids": [3]}]
    out = problem(service.post_job({"samples": samples}), 413)
    assert out["sample_index"] == 1 and out["limit_bytes"] == SAMPLE_LIMIT and "sample 1" in out["detail"]


def test_a_jsonl_file_line_over_the_limit_is_422_naming_the_line(service, unchanged):
    (service.input_root / "long.jsonl").write_bytes(lines(3) + json.dumps({"input_ids": [1] * SAMPLE_LIMIT}).encode())
    out = problem(service.post_job({"input_path": "long.jsonl"}), 422)
    assert out["errors"] == [
        {
            "line": 4,
            "field": "input_path",
            "message": f"line 4 is longer than the limit of {SAMPLE_LIMIT} bytes (--max-sample-bytes)",
        }
    ]


@pytest.mark.parametrize("media,limit", [("application/json", JSON_LIMIT), ("application/x-ndjson", NDJSON_LIMIT)])
def test_a_declared_length_over_the_limit_is_refused_before_the_body(service, unchanged, media, limit):
    upload = RawUpload(service.url, "/v1/jobs", {"Content-Type": media, "Content-Length": str(10**12)})
    try:
        status, headers, body = upload.response()  # not a byte of the body sent
    finally:
        upload.close()
    assert status == 413 and headers["content-type"] == "application/problem+json"
    out = json.loads(body)
    assert out["limit_bytes"] == limit and str(10**12) in out["detail"]


@pytest.mark.parametrize("coding", ["gzip", "br", "deflate", "gzip, identity", "x-unknown"])
def test_an_encoded_body_is_415(service, unchanged, coding):
    resp = service.client.post(
        service.url + "/v1/jobs", json={"samples": [{"input_ids": [1]}]}, headers={"Content-Encoding": coding}
    )
    out = problem(resp, 415)
    assert "Content-Encoding" in out["detail"] and resp.headers["accept-encoding"] == "identity"


def test_an_identity_coded_body_is_read(service):
    resp = service.client.post(
        service.url + "/v1/jobs", json={"samples": [{"input_ids": [1]}]}, headers={"Content-Encoding": "identity"}
    )
    assert resp.status_code == 202, resp.text


def test_the_service_answers_while_a_large_upload_is_half_received(service):
    """One large NDJSON body, half sent: health, reads and small creates are answered meanwhile (on
    SQLite the samples wait outside the transaction, so the write lock is free), and another large
    body is refused at once with 503 and Retry-After, storing nothing; once the first body is
    complete it is stored whole, and a large body is taken again."""
    body = lines(1500, seed=5, width=8)
    assert len(body) > LARGE
    client = httpx.Client(base_url=service.url, timeout=20)
    upload = RawUpload(
        service.url,
        "/v1/jobs?name=large",
        {"Content-Type": "application/x-ndjson", "Content-Length": str(len(body))},
    )
    try:
        upload.send(body[: len(body) // 2])
        assert client.get("/healthz").status_code == 200
        assert client.get("/v1/jobs", params={"limit": 1}).status_code == 200
        small = client.post("/v1/jobs", json={"samples": [{"input_ids": [1, 2]}]})
        assert small.status_code == 202, small.text
        before = stored_rows(service.database_url)
        for other in (
            {"content": b"{}" + b" " * LARGE, "headers": {"content-type": "application/json"}},
            {"content": lines(1500, seed=6, width=8), "headers": NDJSON},
        ):
            busy = client.post("/v1/jobs", **other)
            out = problem(busy, 503)
            assert busy.headers["retry-after"] == "5" and out["type"] == "/problems/busy"
        assert stored_rows(service.database_url) == before
        upload.send(body[len(body) // 2 :])
        status, _, answer = upload.response()
    finally:
        upload.close()
    assert status == 202, answer
    job = json.loads(answer)
    assert job["name"] == "large" and job["counts"]["total"] == 1500 and job["tokens"]["total"] == 1500 * 8
    assert stored_rows(service.database_url) == (before[0] + 1, before[1] + 1500)
    again = client.post("/v1/jobs", content=lines(1500, seed=7, width=8), headers=NDJSON)
    assert again.status_code == 202, again.text


@pytest.mark.parametrize("media", ["ndjson", "json"])
def test_parallel_submissions_with_one_idempotency_key_get_one_job(service, media):
    """Twenty identical requests at once, bodies streamed in pieces: one job, every answer 202 with it."""
    samples = [{"id": f"{media}-{i}", "input_ids": [i % 300, 1, 2]} for i in range(300)]
    if media == "ndjson":
        text = b"".join(json.dumps(s).encode() + b"\n" for s in samples)
        headers = {**NDJSON, "Idempotency-Key": "parallel-ndjson"}
    else:
        text = json.dumps({"samples": samples}).encode()
        headers = {"content-type": "application/json", "Idempotency-Key": "parallel-json"}
    start = threading.Barrier(20)

    def pieces():
        start.wait()
        for i in range(0, len(text), 1000):
            yield text[i : i + 1000]

    def submit(_):
        with httpx.Client(timeout=60) as client:
            return client.post(service.url + "/v1/jobs", content=pieces(), headers=headers)

    before = stored_rows(service.database_url)
    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(submit, range(20)))
    assert [a.status_code for a in answers] == [202] * 20, [a.text for a in answers if a.status_code != 202]
    assert len({a.json()["id"] for a in answers}) == 1
    assert stored_rows(service.database_url) == (before[0] + 1, before[1] + 300)
    other = service.client.post(service.url + "/v1/jobs", content=text.replace(b"[", b"[7, ", 1), headers=headers)
    assert problem(other, 422)["type"] == "/problems/idempotency-key-reused"


def test_a_trailing_slash_redirect_stays_on_the_service(service, unchanged):
    client = httpx.Client(base_url=service.url, headers={"Host": "evil.example"})
    resp = client.get("/v1/jobs/", params={"limit": "1"})
    assert resp.status_code == 307 and resp.headers["location"] == "/v1/jobs?limit=1"
    assert httpx.get(service.url + "/v1/jobs/", follow_redirects=True).status_code == 200
    # A protocol-relative target reaches this service's own page at /, never a redirect elsewhere.
    assert "location" not in client.get("//evil.example/").headers
    problem(client.get("/v1/nothing/"), 404)


def test_every_get_but_the_event_stream_answers_head(service):
    job = service.post_job({"samples": [{"id": "h", "input_ids": [1, 2]}]}).json()
    for path in (
        "/healthz",
        "/metrics",
        "/v1/jobs?limit=5",
        f"/v1/jobs/{job['id']}",
        f"/v1/jobs/{job['id']}/samples",
        f"/v1/jobs/{job['id']}/samples/h",
    ):
        get, head = service.client.get(service.url + path), service.client.head(service.url + path)
        assert head.status_code == get.status_code == 200 and head.content == b"", path
        assert head.headers["content-type"] == get.headers["content-type"], path
    assert service.client.head(service.url + "/v1/jobs/job_nope").status_code == 404
    events = service.client.head(f"{service.url}/v1/jobs/{job['id']}/events")
    assert events.status_code == 405 and events.headers["allow"] == "GET"


def test_an_unsupported_method_is_a_405_problem_naming_the_allowed_ones(service, unchanged):
    resp = service.client.put(service.url + "/v1/jobs", json={})
    problem(resp, 405)
    assert set(resp.headers["allow"].replace(" ", "").split(",")) == {"GET", "HEAD", "POST"}

"""The API users drive over HTTP: lifecycle actions, idempotency, streaming, downloads, events, metrics."""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import httpx
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load

from hsx.db import repository as repo
from hsx.db.engine import make_engine, session_factory
from hsx.manifest import load_manifest, read_sample
from hsx.sdk import HsxClient
from tests.support.api import problem
from tests.support.no_torch import block_torch, pythonpath_with, refused_imports, started_in
from tests.support.procs import Process, hsx_command
from tests.support.samples import assert_stored_exactly, make_samples
from tests.support.stack import VOCAB, start_reference, start_service


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def stack(request, tmp_path_factory, checkpoint):
    tmp = tmp_path_factory.mktemp(f"life-{request.param}")
    url = f"sqlite:///{tmp / 'hsx.db'}" if request.param == "sqlite" else request.getfixturevalue("postgres_module_url")
    ref = start_reference(tmp, checkpoint, extra=["--enable-fault-injection"])
    svc = start_service(
        tmp,
        url,
        backend_url=ref.url,
        dump_root=ref.dump_root,
        extra=["--shard-max-bytes", "100000", "--max-json-bytes", "2000000"],
    )
    yield svc, ref
    svc.stop()
    ref.stop()


def test_list_jobs_pages_newest_first(stack):
    svc, _ = stack
    ids = [svc.post_job({"name": f"list-{i}", "samples": make_samples(1, seed=100 + i)}).json()["id"] for i in range(3)]
    for job_id in ids:
        svc.wait_job(job_id)
    first = svc.get("/v1/jobs", params={"limit": 2}).json()
    assert first["has_more"] and len(first["data"]) == 2
    rest = svc.get("/v1/jobs", params={"limit": 1000, "after": first["next_after"]}).json()
    listed = [j["id"] for j in first["data"] + rest["data"]]
    assert listed == sorted(listed, reverse=True)
    assert listed.index(ids[2]) < listed.index(ids[1]) < listed.index(ids[0])
    succeeded = svc.get("/v1/jobs", params={"state": "succeeded", "limit": 1000}).json()["data"]
    assert {j["state"] for j in succeeded} == {"succeeded"} and set(ids) <= {j["id"] for j in succeeded}


def test_cancel_stores_what_was_in_flight_and_nothing_half(stack, recompute):
    svc, _ = stack
    samples = make_samples(40, seed=11, lo=30, hi=120)
    job = svc.post_job({"samples": samples}).json()
    deadline = time.monotonic() + 60
    while svc.get(f"/v1/jobs/{job['id']}").json()["counts"]["queued"] == 40 and time.monotonic() < deadline:
        time.sleep(0.05)
    resp = svc.client.post(f"{svc.url}/v1/jobs/{job['id']}/cancel")
    assert resp.status_code == 200, resp.text
    assert resp.json()["state"] == "cancelling" and resp.json()["cancel_requested_at"]
    final = svc.wait_job(job["id"])
    c = final["counts"]
    assert final["state"] == "cancelled" and final["finished_at"]
    assert c["succeeded"] + c["cancelled"] == 40 and c["queued"] == c["running"] == c["staged"] == 0
    assert c["cancelled"] > 0
    stored = [s for s in samples if s["id"] in {x.id for x in load_manifest(svc.output_root / job["id"]).samples}]
    assert len(stored) == c["succeeded"]
    manifest = load_manifest(svc.output_root / job["id"])
    for s in stored:
        got = read_sample(svc.output_root / job["id"], manifest, s["id"])
        assert torch.equal(got["layer_8"], recompute(s["input_ids"])[8])
    again = svc.client.post(f"{svc.url}/v1/jobs/{job['id']}/cancel")
    assert again.status_code == 409 and again.headers["content-type"].startswith("application/problem+json")


def test_a_cancelled_job_resumed_by_a_retry_stores_every_sample_once(stack, recompute):
    """Cancelled early, a job goes on under its own id once retried: the samples the cancel left unrun are
    extracted, those stored before stay, its feed numbers its shards 1..n, and its one manifest lists each
    sample once with its own tensors."""
    svc, _ = stack
    samples = make_samples(30, seed=15, lo=30, hi=120)
    job = svc.post_job({"samples": samples}).json()
    deadline = time.monotonic() + 60
    while svc.get(f"/v1/jobs/{job['id']}").json()["counts"]["queued"] == 30 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert svc.client.post(f"{svc.url}/v1/jobs/{job['id']}/cancel").json()["state"] == "cancelling"
    stopped = svc.wait_job(job["id"])
    assert stopped["state"] == "cancelled" and stopped["counts"]["cancelled"] > 0
    before = {s.id: s.shard for s in load_manifest(svc.output_root / job["id"]).samples}
    feed = svc.get(f"/v1/jobs/{job['id']}/shards").json()
    assert feed["complete"] and feed["committed"] == stopped["shards_written"]

    resp = svc.client.post(f"{svc.url}/v1/jobs/{job['id']}/retry")
    assert resp.status_code == 200, resp.text
    assert resp.json()["counts"]["cancelled"] == 0 and resp.json()["state"] in ("running", "succeeded")
    final = svc.wait_job(job["id"])
    manifest = assert_stored_exactly(svc, final, samples, recompute)
    assert {s.id: s.shard for s in manifest.samples if s.id in before} == before, "stored before, kept where it was"
    feed = svc.get(f"/v1/jobs/{job['id']}/shards").json()
    assert feed["complete"] and [s["seq"] for s in feed["data"]] == list(range(1, final["shards_written"] + 1))
    assert sorted(x["id"] for s in feed["data"] for x in s["samples"]) == sorted(s["id"] for s in samples)


def _db(database_url: str):
    engine = make_engine(database_url)
    return engine, session_factory(engine)


def test_cancel_answers_at_once_and_the_api_alone_completes_it(tmp_path, database_url):
    """The API alone (--no-writer): the cancel answers with the job cancelling and every queued sample
    still queued; its background batches cancel them, nothing of the job is claimed meanwhile, and
    the job ends cancelled once the sample a writer was extracting has ended too."""
    svc = start_service(tmp_path, database_url, extra=["--no-writer", "--cancel-batch", "7"])
    engine, sessions = _db(database_url)
    try:
        job = svc.post_job({"samples": make_samples(50, seed=70)}).json()
        with sessions.begin() as s:  # a writer elsewhere is extracting the first sample
            in_flight = repo.claim_next(s, "elsewhere:/dumps")
        resp = svc.client.post(f"{svc.url}/v1/jobs/{job['id']}/cancel")
        assert resp.status_code == 200, resp.text
        first = resp.json()
        assert first["state"] == "cancelling" and first["cancel_requested_at"] and first["finished_at"] is None
        assert (first["counts"]["queued"], first["counts"]["running"], first["counts"]["cancelled"]) == (49, 1, 0)
        again = svc.client.post(f"{svc.url}/v1/jobs/{job['id']}/cancel")
        assert again.status_code == 200 and again.json()["state"] == "cancelling"
        assert again.json()["cancel_requested_at"] == first["cancel_requested_at"]
        problem(svc.client.post(f"{svc.url}/v1/jobs/{job['id']}/retry"), 409)
        assert "cancelling" in problem(svc.client.delete(f"{svc.url}/v1/jobs/{job['id']}"), 409)["detail"]

        deadline = time.monotonic() + 60
        while svc.get(f"/v1/jobs/{job['id']}").json()["counts"]["queued"] and time.monotonic() < deadline:
            time.sleep(0.05)
        drained = svc.get(f"/v1/jobs/{job['id']}").json()
        assert drained["state"] == "cancelling", "a sample is still running: the job is not finished"
        assert (drained["counts"]["queued"], drained["counts"]["cancelled"]) == (0, 49)
        with sessions.begin() as s:
            assert repo.claim_next(s, "another:/dumps") is None
            repo.release_interrupted(s, in_flight, reason="model server restarted")  # cancelled: its job is
        final = svc.wait_job(job["id"], timeout=60)
        assert final["state"] == "cancelled" and final["finished_at"]
        assert final["counts"]["cancelled"] == 50 and final["tokens"]["total"] == job["tokens"]["total"]
        assert (svc.output_root / job["id"] / "manifest.json").exists()
        problem(svc.client.post(f"{svc.url}/v1/jobs/{job['id']}/cancel"), 409)
        assert svc.client.delete(f"{svc.url}/v1/jobs/{job['id']}").status_code == 204
    finally:
        svc.stop()
        engine.dispose()


def test_concurrent_deletes_of_a_finished_job_are_one_204_and_404s(tmp_path, database_url):
    """Deletes racing on one finished job: the one that wins deletes it, every other finds it gone (404),
    never the 409 meant for a job that is not finished."""
    svc = start_service(tmp_path, database_url, extra=["--no-writer"])
    try:
        job = svc.post_job({"samples": make_samples(3, seed=71)}).json()
        assert svc.client.post(f"{svc.url}/v1/jobs/{job['id']}/cancel").status_code == 200
        assert svc.wait_job(job["id"], timeout=60)["state"] == "cancelled"

        def delete(_):
            with httpx.Client(timeout=30) as c:
                return c.delete(f"{svc.url}/v1/jobs/{job['id']}").status_code

        with ThreadPoolExecutor(16) as pool:
            codes = list(pool.map(delete, range(32)))
        assert sorted(codes) == [204] + [404] * 31, codes
    finally:
        svc.stop()


def test_concurrent_deletes_with_files_are_204_or_404_and_leave_no_folder(tmp_path, database_url):
    """Deletes with delete_files=true racing on one finished job: the one that deletes the records removes
    the folder, the others find the records gone and remove what is left of the folder with it (204) or
    find nothing (404); none fails on a file another removed first. The folder holds many files, as a
    long job's leaves it, so that the removals overlap."""
    svc = start_service(tmp_path, database_url, extra=["--no-writer"])
    codes: list[int] = []
    try:
        for round_ in range(6):
            job = svc.post_job({"samples": make_samples(3, seed=80 + round_)}).json()
            assert svc.client.post(f"{svc.url}/v1/jobs/{job['id']}/cancel").status_code == 200
            assert svc.wait_job(job["id"], timeout=60)["state"] == "cancelled"
            folder = svc.output_root / job["id"]
            for n in range(1500):
                (folder / f"shard-{n:06d}.safetensors").write_bytes(b"x")

            def delete(_, job_id=job["id"]):
                with httpx.Client(timeout=30) as c:
                    return c.delete(f"{svc.url}/v1/jobs/{job_id}", params={"delete_files": "true"})

            with ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(delete, range(4)))
            codes += [a.status_code for a in answers]
            for answer in answers:
                if answer.status_code != 204:
                    problem(answer, 404)
            assert 204 in codes[-4:] and not folder.exists()
            problem(svc.get(f"/v1/jobs/{job['id']}"), 404)
        assert set(codes) <= {204, 404}, codes
        assert "Traceback" not in svc.proc.log()
    finally:
        svc.stop()


def test_a_cancel_the_stopped_api_left_half_done_is_completed_by_a_worker(tmp_path, database_url):
    """The API that took the cancel died after one batch; only a worker runs against the database
    afterwards (its model server not even up): the worker completes the cancel at its start."""
    svc = start_service(tmp_path, database_url, extra=["--no-writer"])
    job = svc.post_job({"samples": make_samples(40, seed=71)}).json()
    svc.stop()
    engine, sessions = _db(database_url)
    with sessions.begin() as s:
        repo.cancel_job(s, job["id"])
    with sessions.begin() as s:
        assert repo.cancel_queued(s, job["id"], 10) == 10
    worker = Process(
        hsx_command()
        + ["worker", "--database-url", database_url, "--output-root", str(svc.output_root)]
        + ["--dump-root", str(tmp_path / "dumps"), "--backend-url", "http://127.0.0.1:9", "--cancel-batch", "7"],
        tmp_path / "worker.log",
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with sessions() as s:
                found = repo.get_job(s, job["id"])
            if found.state == "cancelled":
                break
            time.sleep(0.1)
        assert (found.state, found.n_queued, found.n_cancelled) == ("cancelled", 0, 40), worker.log()
        assert (svc.output_root / job["id"] / "manifest.json").exists()
    finally:
        worker.stop()
        engine.dispose()


def test_retry_and_delete(stack):
    svc, ref = stack
    # Every dump comes out a token short: each sample fails its attempts with the reason.
    faults = f"{ref.url}/admin/faults"
    httpx.post(faults, json={"bad_dumps": {"probability": 1.0, "kind": "wrong_num_tokens"}}).raise_for_status()
    try:
        job = svc.wait_job(svc.post_job({"samples": make_samples(2, seed=12)}).json()["id"])
        assert job["state"] == "failed" and job["counts"]["failed"] == 2
        failed = svc.get(f"/v1/jobs/{job['id']}/samples", params={"state": "failed"}).json()["data"]
        reasons = [s["last_error"] for s in failed]
        assert len(reasons) == 2 and all("num_tokens" in r for r in reasons), reasons
        resp = svc.client.post(f"{svc.url}/v1/jobs/{job['id']}/retry")
        assert resp.status_code == 200 and resp.json()["counts"]["queued"] + resp.json()["counts"]["running"] >= 1
        job = svc.wait_job(job["id"])
        assert job["state"] == "failed"  # the server still damages every dump: failed again, with its reason
    finally:
        httpx.delete(faults).raise_for_status()
    retried = svc.client.post(f"{svc.url}/v1/jobs/{job['id']}/retry")
    assert retried.status_code == 200
    assert svc.wait_job(job["id"])["state"] == "succeeded", "once the server is fixed a retry stores them"
    ok = svc.wait_job(svc.post_job({"samples": make_samples(1, seed=13)}).json()["id"])
    assert svc.client.post(f"{svc.url}/v1/jobs/{ok['id']}/retry").status_code == 409
    running = svc.post_job({"samples": make_samples(30, seed=14, lo=60, hi=120)}).json()
    refused = svc.client.delete(f"{svc.url}/v1/jobs/{running['id']}")
    assert refused.status_code in (409, 204)
    if refused.status_code == 409:
        svc.client.post(f"{svc.url}/v1/jobs/{running['id']}/cancel")
        svc.wait_job(running["id"])
    assert (svc.output_root / ok["id"] / "manifest.json").exists()
    # A finished job whose folder was moved away: gone (410), as its shards and manifest are elsewhere.
    folder = svc.output_root / ok["id"]
    folder.rename(folder.with_name("moved-away"))
    gone = problem(svc.client.post(f"{svc.url}/v1/jobs/{ok['id']}/verify"), 410)
    assert "manifest.json" in gone["missing_shards"]
    folder.with_name("moved-away").rename(folder)
    assert svc.client.delete(f"{svc.url}/v1/jobs/{ok['id']}", params={"delete_files": "true"}).status_code == 204
    assert svc.get(f"/v1/jobs/{ok['id']}").status_code == 404
    assert not (svc.output_root / ok["id"]).exists()


def test_idempotency_key(stack):
    svc, _ = stack
    body = {"samples": make_samples(2, seed=20)}
    first = svc.client.post(svc.url + "/v1/jobs", json=body, headers={"Idempotency-Key": "k-1"})
    second = svc.client.post(svc.url + "/v1/jobs", json=body, headers={"Idempotency-Key": "k-1"})
    assert first.status_code == second.status_code == 202
    assert first.json()["id"] == second.json()["id"]
    other = svc.client.post(
        svc.url + "/v1/jobs", json={"samples": make_samples(3, seed=21)}, headers={"Idempotency-Key": "k-1"}
    )
    assert other.status_code == 422 and "Idempotency-Key" in other.json()["detail"]
    lines = "".join(json.dumps(s) + "\n" for s in make_samples(3, seed=22)).encode()
    nd = {"content-type": "application/x-ndjson", "Idempotency-Key": "k-2"}
    a = svc.client.post(svc.url + "/v1/jobs", content=lines, headers=nd)
    b = svc.client.post(svc.url + "/v1/jobs", content=lines, headers=nd)
    assert a.status_code == b.status_code == 202 and a.json()["id"] == b.json()["id"]
    c = svc.client.post(svc.url + "/v1/jobs", content=lines + lines[:0] + b"\n", headers=nd)
    assert c.status_code == 422


def test_ndjson_stream_and_backend_validation(stack):
    svc, _ = stack
    n = 3000

    def body():
        for i in range(n):
            yield (json.dumps({"id": f"nd-{i}", "input_ids": [i % VOCAB, 1, 2]}) + "\n").encode()

    before = svc.get("/v1/jobs", params={"limit": 1000}).json()["data"]
    resp = svc.client.post(
        svc.url + "/v1/jobs",
        content=body(),
        params={"name": "streamed", "layers": "2,4,5,8"},
        headers={"content-type": "application/x-ndjson"},
    )
    assert resp.status_code == 202, resp.text
    job = resp.json()
    assert job["counts"]["total"] == n and job["tokens"]["total"] == 3 * n and job["layers"] == [2, 4, 5, 8]
    svc.client.post(f"{svc.url}/v1/jobs/{job['id']}/cancel")

    bad = [json.dumps({"input_ids": [1, 2]}), json.dumps({"input_ids": [VOCAB]}), "{oops"]
    resp = svc.client.post(
        svc.url + "/v1/jobs", content="\n".join(bad).encode(), headers={"content-type": "application/x-ndjson"}
    )
    assert resp.status_code == 422
    assert [(e["sample_index"], e["line"], e["field"]) for e in resp.json()["errors"]] == [
        (1, 2, "input_ids.0"),
        (2, 3, "sample"),
    ]
    too_long = svc.post_job({"samples": [{"input_ids": [1] * 5000}]})
    assert too_long.status_code == 422 and "limit" in too_long.json()["errors"][0]["message"]
    after = svc.get("/v1/jobs", params={"limit": 1000}).json()["data"]
    assert len(after) == len(before) + 1
    plain = svc.client.post(svc.url + "/v1/jobs", content=b"x", headers={"content-type": "text/plain"})
    assert plain.status_code == 415
    big = svc.post_job({"samples": [{"input_ids": [1] * 1000}] * 1500})  # ~3 MB of compact JSON
    assert big.status_code == 413 and big.headers["content-type"].startswith("application/problem+json")


def test_downloads_events_and_metrics(stack, recompute):
    svc, _ = stack
    samples = make_samples(5, seed=30)
    job_id = svc.post_job({"samples": samples}).json()["id"]
    states = []
    with svc.client.stream("GET", f"{svc.url}/v1/jobs/{job_id}/events", timeout=120) as events:
        assert events.headers["content-type"].startswith("text/event-stream")
        for line in events.iter_lines():
            if line.startswith("data: "):
                states.append(json.loads(line[6:])["state"])
    assert states[-1] == "succeeded" and len(states) >= 2
    job = svc.get(f"/v1/jobs/{job_id}").json()
    manifest = assert_stored_exactly(svc, job, samples, recompute)

    shard = manifest.shards[0]
    url = f"{svc.url}/v1/jobs/{job_id}/shards/{shard.name}"
    whole = svc.client.get(url)
    assert whole.headers["etag"] == f'"{shard.sha256}"'
    assert hashlib.sha256(whole.content).hexdigest() == shard.sha256
    part = svc.client.get(url, headers={"Range": "bytes=100-199"})
    assert part.status_code == 206 and part.content == whole.content[100:200]
    assert part.headers["content-range"] == f"bytes 100-199/{shard.bytes}"
    assert svc.client.get(url, headers={"If-None-Match": whole.headers["etag"]}).status_code == 304
    past = svc.client.get(url, headers={"Range": f"bytes={shard.bytes}-"})
    assert past.status_code == 416 and past.headers["content-type"].startswith("application/problem+json")
    for unusable in ("bytes=200-100", "items=0-1"):  # RFC 9110: a Range that cannot be used is ignored
        ignored = svc.client.get(url, headers={"Range": unusable})
        assert ignored.status_code == 200 and ignored.content == whole.content
    huge = svc.client.get(url, headers={"Range": "bytes=" + "9" * 5000 + "-"})
    assert huge.status_code == 416 and huge.headers["content-type"].startswith("application/problem+json")

    one = svc.client.get(f"{svc.url}/v1/jobs/{job_id}/tensors/{samples[2]['id']}")
    assert one.status_code == 200
    tensors = load(one.content)
    assert tensors["input_ids"].tolist() == samples[2]["input_ids"]
    assert torch.equal(tensors["layer_5"], recompute(samples[2]["input_ids"])[5])

    report = svc.client.post(f"{svc.url}/v1/jobs/{job_id}/verify").json()
    assert report["ok"] is True and report["summary"]["samples"] == 5, report
    running = svc.post_job({"samples": make_samples(20, seed=31, lo=60, hi=120)}).json()
    assert svc.client.post(f"{svc.url}/v1/jobs/{running['id']}/verify").status_code == 409
    svc.client.post(f"{svc.url}/v1/jobs/{running['id']}/cancel")

    text = svc.get("/metrics").text
    assert 'hsx_samples{state="succeeded"}' in text and "hsx_backend_request_seconds_bucket" in text
    assert 'hsx_attempts_total{outcome="ok",reason=""}' in text and "hsx_tokens_per_second" in text


def test_throughput_shards_and_writer_rate(stack):
    svc, _ = stack
    samples = make_samples(6, seed=33, lo=20, hi=60)
    job = svc.wait_job(svc.post_job({"samples": samples}).json()["id"])
    assert job["state"] == "succeeded"
    history = svc.get(f"/v1/jobs/{job['id']}/throughput").json()
    width, points = history["window_s"], history["points"]
    assert history["job_id"] == job["id"] and width % 5 == 0 and points
    assert sum(p["samples"] for p in points) == 6 and sum(p["tokens"] for p in points) == job["tokens"]["total"]
    starts = [datetime.fromisoformat(p["start"]).timestamp() for p in points]
    assert all(b - a == width for a, b in itertools.pairwise(starts)), "windows follow each other, gaps included"
    assert all(0 <= p["seconds"] <= width for p in points)
    # tokens_per_s is rounded to 3 decimals
    rates = [(p["tokens_per_s"], p["tokens"] / p["seconds"]) for p in points if p["seconds"]]
    assert all(got == pytest.approx(want, rel=1e-3, abs=1e-3) for got, want in rates)
    (whole,) = svc.get(f"/v1/jobs/{job['id']}/throughput", params={"points": 1}).json()["points"]
    assert whole["samples"] == 6 and whole["tokens"] == job["tokens"]["total"]
    assert svc.get(f"/v1/jobs/{job['id']}/throughput", params={"points": 0}).status_code == 422
    assert svc.get("/v1/jobs/job_nope/throughput").status_code == 404

    shards = svc.get(f"/v1/jobs/{job['id']}/shards").json()["data"]
    manifest = svc.get(f"/v1/jobs/{job['id']}/manifest").json()
    assert [(s["name"], s["sha256"], s["bytes"]) for s in shards] == [
        (s["name"], s["sha256"], s["bytes"]) for s in manifest["shards"]
    ]
    assert sum(s["num_samples"] for s in shards) == 6
    first = svc.get(shards[0]["url"])
    assert hashlib.sha256(first.content).hexdigest() == shards[0]["sha256"]
    assert svc.get("/v1/jobs/job_nope/shards").status_code == 404

    health = svc.get("/healthz").json()
    assert health["writer"]["tokens_per_s"] > 0, "the job was extracted within the last minute"
    (writer,) = health["writers"]
    assert writer["identity"] == health["writer"]["identity"] and writer["tokens_per_s"] is not None
    assert svc.get("/v1/token").json() == {"object": "token", "tokens_required": False, "role": "write"}


def test_shard_downloads_follow_rfc_9110(stack):
    """HEAD, conditional and partial GETs of a shard: an unparseable Range is ignored (200, whole), an
    unsatisfiable one is a 416 problem naming the size, If-None-Match takes weak tags, lists and *."""
    svc, _ = stack
    samples = make_samples(3, seed=35)
    job = svc.wait_job(svc.post_job({"samples": samples}).json()["id"])
    shard = svc.get(f"/v1/jobs/{job['id']}/manifest").json()["shards"][0]
    url = f"{svc.url}/v1/jobs/{job['id']}/shards/{shard['name']}"
    whole = svc.client.get(url).content
    size, etag = len(whole), f'"{shard["sha256"]}"'

    head = svc.client.head(url)
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-length"] == str(size) and head.headers["etag"] == etag
    head = svc.client.head(url, headers={"Range": "bytes=0-9"})
    assert head.status_code == 206 and head.headers["content-range"] == f"bytes 0-9/{size}" and head.content == b""

    for header in ("bytes=abc", "bytes=5-1", "bytes=", "items=0-9", "bytes=0-1,x", "bytes=" + "0-0," * 20):
        resp = svc.client.get(url, headers={"Range": header})
        assert resp.status_code == 200 and resp.content == whole, header
    for header in (f"bytes={size}-", f"bytes={size}-{size + 10}", "bytes=-0"):
        resp = svc.client.get(url, headers={"Range": header})
        out = problem(resp, 416)
        assert resp.headers["content-range"] == f"bytes */{size}" and out["size_bytes"] == size, header
    resp = svc.client.get(url, headers={"Range": f"bytes=-10, {size}-"})
    assert resp.status_code == 206 and resp.content == whole[-10:]
    resp = svc.client.get(url, headers={"Range": "bytes=0-9", "If-Range": '"another"'})
    assert resp.status_code == 200 and resp.content == whole
    resp = svc.client.get(url, headers={"Range": "bytes=0-9", "If-Range": etag})
    assert resp.status_code == 206 and resp.content == whole[:10]

    for header in (etag, f"W/{etag}", f'"other", {etag}', f'W/"x" , W/{etag}', "*"):
        for method in ("GET", "HEAD"):
            resp = svc.client.request(method, url, headers={"If-None-Match": header})
            assert resp.status_code == 304 and resp.content == b"" and resp.headers["etag"] == etag, header
    for header in ('"other"', 'W/"other", "x"', shard["sha256"]):
        assert svc.client.get(url, headers={"If-None-Match": header}).status_code == 200, header

    sample = svc.client.head(f"{svc.url}/v1/jobs/{job['id']}/tensors/{samples[0]['id']}")
    assert sample.status_code == 200 and sample.content == b"" and int(sample.headers["content-length"]) > 0
    manifest = svc.client.head(f"{svc.url}/v1/jobs/{job['id']}/manifest")
    assert manifest.status_code == 200 and manifest.content == b""
    assert manifest.headers["content-type"] == "application/json"
    problem(svc.client.get(f"{svc.url}/v1/jobs/{job['id']}/shards/nope"), 404)
    assert svc.client.head(f"{svc.url}/v1/jobs/{job['id']}/shards/nope").status_code == 404


def test_tensors_are_served_without_torch(stack, tmp_path, monkeypatch):
    svc, _ = stack
    samples = make_samples(3, seed=40)
    job = svc.wait_job(svc.post_job({"samples": samples}).json()["id"])
    assert job["state"] == "succeeded"
    blocker = block_torch(tmp_path / "no-torch")
    monkeypatch.setenv("PYTHONPATH", pythonpath_with(blocker))
    # An API-only service on the same database and output root (start_service puts it under the folder given).
    api = start_service(svc.output_root.parent, svc.database_url, extra=["--no-writer"])
    try:
        folder = svc.output_root / job["id"]
        manifest = load_manifest(folder)
        assert manifest.dtype == "bfloat16"
        for i, s in enumerate(samples):
            resp = api.get(f"/v1/jobs/{job['id']}/tensors/{s['id']}")
            assert resp.status_code == 200, resp.text
            assert resp.headers["content-disposition"] == f'attachment; filename="sample-{i}.safetensors"'
            got, want = load(resp.content), read_sample(folder, manifest, s["id"])
            assert got.keys() == want.keys() == {"input_ids", "loss_mask"} | {f"layer_{n}" for n in manifest.layers}
            for name, tensor in want.items():
                assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
            answer = tmp_path / f"{i}.safetensors"
            answer.write_bytes(resp.content)
            with safe_open(str(answer), framework="pt") as f:
                assert f.metadata() == {"sample_id": s["id"], "job_id": job["id"]}
        unknown = api.get(f"/v1/jobs/{job['id']}/tensors/nope")
        assert unknown.status_code == 404
        report = api.client.post(f"{api.url}/v1/jobs/{job['id']}/verify")
        assert report.status_code == 200 and report.json()["ok"] is True, report.text
    finally:
        api.stop()
    assert started_in(blocker, api.proc.proc.pid)
    assert refused_imports(blocker) == []


def test_awkward_sample_ids_are_reachable(stack):
    """Every id creation accepts reaches its sample and its tensors: slashes (the last, path-typed part of
    the URL), dot segments, unicode, blanks, URL syntax, the longest ids (200 characters, as Postgres
    counts them). The SDK percent-encodes them; a raw client encodes at least what is not plain."""
    svc, _ = stack
    ids = ["conv/7", "x/tensors", ".", "..", "a/../b", "/", "é ✓ \U0001f600", " spaced ", "?q#f%", "x" * 200]
    ids.append("\U0001f600" * 200)
    samples = [{"id": sid, "input_ids": [5 + i, 6, 7][: 1 + i % 3]} for i, sid in enumerate(ids)]
    job = svc.wait_job(svc.post_job({"samples": samples}).json()["id"])
    assert job["state"] == "succeeded"
    with HsxClient(svc.url) as client:
        for s in samples:
            assert client.get_sample(job["id"], s["id"]).id == s["id"]
            assert client.sample_tensors(job["id"], s["id"])["input_ids"].tolist() == s["input_ids"]
    quoted = "conv%2F7"  # raw, as a client without the SDK writes it; "/" may also stay as it is
    for path in (f"samples/{quoted}", "samples/conv/7"):
        assert svc.get(f"/v1/jobs/{job['id']}/{path}").json()["id"] == "conv/7"
    assert (
        load(svc.get(f"/v1/jobs/{job['id']}/tensors/conv/7").content)["input_ids"].tolist() == samples[0]["input_ids"]
    )


def test_health_without_a_token_says_only_whether_the_service_can_work(tmp_path):
    """With --api-tokens, /healthz answers anyone, but where the service runs (host, dump root, model
    server) only to a token."""
    svc = start_service(tmp_path, f"sqlite:///{tmp_path / 'auth.db'}", extra=["--api-tokens", "reader-secret:read"])
    try:
        deadline = time.monotonic() + 30
        while not svc.get("/healthz", headers={"Authorization": "Bearer reader-secret"}).json()["writers"]:
            assert time.monotonic() < deadline, "the writer never reported"
            time.sleep(0.2)
        anyone = svc.get("/healthz").json()
        assert anyone["status"] == "degraded" and anyone["database"] == "ok" and anyone["writers"] == []
        assert set(anyone["writer"]) == {"state"}
        assert str(tmp_path) not in json.dumps(anyone) and "127.0.0.1:9" not in json.dumps(anyone)
        told = svc.get("/healthz", headers={"Authorization": "Bearer reader-secret"}).json()
        assert told["writer"]["identity"].endswith(str(tmp_path / "dumps")) and told["writers"]
    finally:
        svc.stop()


def test_tokens_guard_everything_but_health(tmp_path):
    svc = start_service(
        tmp_path,
        f"sqlite:///{tmp_path / 'auth.db'}",
        extra=["--no-writer", "--api-tokens", "writer-secret,reader-secret:read"],
    )
    try:
        c = httpx.Client(base_url=svc.url)
        assert c.get("/healthz").status_code == 200
        # The dashboard's page and files hold no data: the browser loads them before it has a token to send.
        page = c.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in page.headers["content-security-policy"]
        assert c.get("/dashboard/dashboard.js").headers["content-type"].startswith("text/javascript")
        assert c.get("/dashboard/nothing.js").status_code == 404
        assert c.get("/v1/token").status_code == 401
        assert c.get("/v1/token", headers={"Authorization": "Bearer reader-secret"}).json()["role"] == "read"
        writer = c.get("/v1/token", headers={"Authorization": "Bearer writer-secret"}).json()
        assert writer == {"object": "token", "tokens_required": True, "role": "write"}
        for path in ("/v1/jobs", "/metrics", "/openapi.json", "/docs"):
            r = c.get(path)
            assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
            assert r.headers["content-type"].startswith("application/problem+json")
        assert c.get("/v1/jobs", headers={"Authorization": "Bearer nope"}).status_code == 401
        read = {"Authorization": "Bearer reader-secret"}
        assert c.get("/v1/jobs", headers=read).status_code == 200
        # verify only reads: a read token may run it (404: no such job, past the token check)
        assert c.post("/v1/jobs/job_nope/verify", headers=read).status_code == 404
        denied = c.post("/v1/jobs", json={"samples": [{"input_ids": [1]}]}, headers=read)
        assert denied.status_code == 403 and denied.json()["status"] == 403
        ok = c.post(
            "/v1/jobs", json={"samples": [{"input_ids": [1]}]}, headers={"Authorization": "Bearer writer-secret"}
        )
        assert ok.status_code == 202
    finally:
        svc.stop()

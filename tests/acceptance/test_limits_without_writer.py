"""An API without a writer in its process (`hsx serve --no-writer`) checks submitted samples against the
model server's limits as one with a writer does: an `hsx worker` registers its server's vocabulary and
longest prompt in the database, and the API refuses ids outside that vocabulary and prompts longer than
that (or skips or truncates them, by the job's policy) before anything is stored or sent. Real
processes on each database: a synthetic reference server, a worker, the API alone."""

from __future__ import annotations

import json
import time

import pytest

from tests.support.api import problem, stored_rows
from tests.support.procs import Process, hsx_command, start_synthetic
from tests.support.stack import Service, start_service

VOCAB, CONTEXT = 1000, 64


@pytest.fixture
def api_and_worker(tmp_path, database_url):
    """A synthetic server (vocabulary VOCAB, prompts of at most CONTEXT tokens) with an `hsx worker` beside
    it, and the API alone, whose --backend-url answers nothing: only the worker's registration tells it
    the limits. Yields once the worker has registered them."""
    server, url = start_synthetic(
        tmp_path,
        hidden=32,
        num_layers=4,
        vocab=VOCAB,
        dump_root=tmp_path / "dumps",
        extra=["--name-by", "rid", "--context-length", str(CONTEXT)],
    )
    parts = [server]
    try:
        # The API first: it migrates the new database and marks the output root before the worker starts.
        svc = start_service(tmp_path, database_url, extra=["--no-writer"])
        parts.append(svc)
        worker = Process(
            hsx_command()
            + ["worker", "--backend-url", url, "--dump-root", str(tmp_path / "dumps"), "--database-url", database_url]
            + ["--output-root", str(tmp_path / "output")],
            tmp_path / "worker.log",
        )
        parts.append(worker)
        deadline = time.monotonic() + 60
        while not [w for w in svc.get("/v1/workers").json()["data"] if w["state"] == "ready"]:
            assert time.monotonic() < deadline, worker.log()[-3000:]
            time.sleep(0.2)
        yield svc, worker
    finally:
        for part in reversed(parts):
            part.stop()


def test_the_api_alone_applies_the_workers_limits(api_and_worker):
    svc, worker = api_and_worker
    [registered] = svc.get("/v1/workers").json()["data"]
    assert (registered["vocab_size"], registered["max_prompt_tokens"]) == (VOCAB, CONTEXT)
    before = stored_rows(svc)

    err = problem(svc.post_job({"samples": [{"input_ids": [1, 2]}, {"input_ids": [3, VOCAB]}]}), 422)["errors"]
    assert [(e["sample_index"], e["field"]) for e in err] == [(1, "input_ids.1")]
    assert f"outside [0, {VOCAB})" in err[0]["message"]

    err = problem(svc.post_job({"samples": [{"input_ids": [1] * (CONTEXT + 1)}]}), 422)["errors"]
    assert err[0]["message"] == f"{CONTEXT + 1} tokens exceed the model server's limit of {CONTEXT}"

    line = json.dumps({"id": "long", "input_ids": [1] * (CONTEXT + 1)}).encode() + b"\n"
    resp = svc.client.post(svc.url + "/v1/jobs", content=line, headers={"content-type": "application/x-ndjson"})
    assert problem(resp, 422)["errors"][0]["line"] == 1, "an NDJSON body alike"
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"input_ids": [[1, 2], [VOCAB + 5]]}), svc.input_root / "rows.parquet")
    err = problem(svc.post_job({"input_path": "rows.parquet"}), 422)["errors"]
    assert [(e["row"], e["field"]) for e in err] == [(1, "input_ids.0")], "a Parquet file alike"
    assert stored_rows(svc) == before, "a refused request stores nothing"

    # The job's policies apply to the registered limit as to its own max_length.
    resp = svc.post_job(
        {
            "samples": [{"id": "a", "input_ids": [1] * (CONTEXT + 1)}, {"id": "b", "input_ids": [2, 3]}],
            "length_policy": "skip",
        }
    )
    assert resp.status_code == 202, resp.text
    job = resp.json()
    assert (job["counts"]["skipped"], job["counts"]["queued"]) == (1, 1)
    skipped = svc.get(f"/v1/jobs/{job['id']}/samples/a").json()
    assert skipped["last_error"] == f"too_long: {CONTEXT + 1} tokens exceed the model server's limit of {CONTEXT}"
    assert svc.wait_job(job["id"], timeout=120)["state"] == "succeeded", worker.log()[-3000:]


def test_a_job_no_live_worker_may_run_is_checked_without_their_limits(api_and_worker):
    """The limits are those of the live workers that may run the job: one asking for layers no worker
    gives is checked against none (it waits, saying why), and once the worker has stopped, its limits
    no longer apply either."""
    svc, worker = api_and_worker
    resp = svc.post_job({"samples": [{"input_ids": [VOCAB + 1]}], "layers": [3]})  # within its depth, not given
    assert resp.status_code == 202, resp.text
    assert "no live worker serves this job" in svc.get(f"/v1/jobs/{resp.json()['id']}").json()["waiting_reason"]
    worker.stop()
    assert svc.get("/v1/workers").json()["data"][0]["state"] == "stopped"
    resp = svc.post_job({"samples": [{"input_ids": [VOCAB + 1] * (CONTEXT + 1)}]})
    assert resp.status_code == 202, resp.text


def test_a_worker_registers_what_its_server_accepts(api_and_worker, database_url):
    """The registration is in the database, where any API on it reads it: a second API reads the same,
    and takes as a job's tokenizer the model path the worker's server reports (here not even a path),
    with no tokenizer roots named."""
    svc, _ = api_and_worker
    [registered] = svc.get("/v1/workers").json()["data"]
    other: Service = start_service(svc.output_root.parent, database_url, extra=["--no-writer"])
    try:
        problem(other.post_job({"samples": [{"input_ids": [VOCAB]}]}), 422)
        conversation = {"messages": [{"role": "user", "content": "hi"}]}
        resp = other.post_job({"samples": [conversation], "tokenizer": registered["model_path"]})
        assert resp.status_code == 202, resp.text
        err = problem(other.post_job({"samples": [conversation], "tokenizer": "/models/x"}), 422)["errors"]
        assert err[0]["field"] == "tokenizer"
    finally:
        other.stop()

"""A job end to end over real HTTP: reference server subprocess, service subprocess, SQLite and Postgres.

Every stored tensor must equal what transformers computes for that sample, bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time

import httpx
from transformers import LlamaConfig

from hsx.exports import export_job
from tests.support.procs import free_port
from tests.support.samples import assert_stored_exactly, make_samples
from tests.support.stack import HIDDEN, NUM_LAYERS, VOCAB, start_reference, start_service


def test_job_end_to_end_counter_mode(tmp_path, database_url, checkpoint, recompute):
    ref = start_reference(tmp_path, checkpoint)
    svc = start_service(
        tmp_path, database_url, backend_url=ref.url, dump_root=ref.dump_root, extra=["--shard-max-bytes", "200000"]
    )
    try:
        samples = make_samples(14, seed=1)
        resp = svc.post_job({"name": "e2e", "samples": samples})
        assert resp.status_code == 202, resp.text
        created = resp.json()
        assert created["state"] == "queued" and created["counts"]["total"] == 14
        job = svc.wait_job(created["id"])
        manifest = assert_stored_exactly(svc, job, samples, recompute)
        assert len(manifest.shards) >= 2, "a small shard size must roll over into several shards"
        # The model as the server and its checkpoint's config.json describe it, and which layer is
        # taken after the final norm; an export reads them from manifest.json.
        assert manifest.model == {
            "model_path": str(checkpoint),
            "model_type": "llama",
            "num_hidden_layers": NUM_LAYERS,
            "hidden_size": HIDDEN,
            "rms_norm_eps": LlamaConfig().rms_norm_eps,
            "vocab_size": VOCAB,
        }
        assert manifest.post_norm_layers == [NUM_LAYERS]
        exported = export_job("specforge", svc.output_root / job["id"], tmp_path / "specforge")
        assert exported.written == 14
        assert any(f"hidden_state = hsx layer {NUM_LAYERS} (after the final norm)" in n for n in exported.notes)

        page1 = svc.get(f"/v1/jobs/{job['id']}/samples", params={"limit": 5}).json()
        page2 = svc.get(f"/v1/jobs/{job['id']}/samples", params={"limit": 5, "after": page1["next_after"]}).json()
        assert [s["index"] for s in page1["data"] + page2["data"]] == list(range(10))
        first = page1["data"][0]
        assert first["state"] == "succeeded" and first["observed_tokens"] == first["expected_tokens"]
        detail = svc.get(f"/v1/jobs/{job['id']}/samples/{first['id']}").json()
        assert detail["attempt_log"][-1]["outcome"] == "ok"

        shard = manifest.shards[0]
        download = svc.get(f"/v1/jobs/{job['id']}/shards/{shard.name}")
        assert download.status_code == 200
        assert hashlib.sha256(download.content).hexdigest() == shard.sha256
        assert not any((svc.output_root / job["id"]).glob(".*tmp*")), "no temporary file may be left behind"
    finally:
        svc.stop()
        ref.stop()


def test_job_end_to_end_rid_mode(tmp_path, checkpoint, recompute):
    ref = start_reference(tmp_path, checkpoint, extra=["--name-by", "rid"])
    svc = start_service(tmp_path, f"sqlite:///{tmp_path / 'hsx.db'}", backend_url=ref.url, dump_root=ref.dump_root)
    try:
        samples = make_samples(6, seed=2)
        job = svc.wait_job(svc.post_job({"samples": samples}).json()["id"])
        assert_stored_exactly(svc, job, samples, recompute)
        dumps = [svc.get(f"/v1/jobs/{job['id']}/samples/{s['id']}").json()["attempt_log"][-1]["dump"] for s in samples]
        assert all(d.startswith(f"req_hsx-{job['id']}-") for d in dumps), dumps
    finally:
        svc.stop()
        ref.stop()


def test_foreign_requests_never_yield_a_wrong_sample(tmp_path, database_url, checkpoint, recompute):
    """The seed incident: warm-up, health checks and other clients consume counter values while
    a job runs. Nothing stored may belong to another request."""
    dump_root = tmp_path / "dumps"
    port = free_port()
    svc = start_service(tmp_path, database_url, backend_url=f"http://127.0.0.1:{port}", dump_root=dump_root)
    samples = make_samples(16, seed=3, lo=2, hi=40)
    job_id = svc.post_job({"samples": samples}).json()["id"]
    stop = threading.Event()
    foreign = {"health": 0, "generate": 0}

    def traffic(url: str) -> None:
        rng = random.Random(9)
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                try:
                    if rng.random() < 0.5:
                        c.get(url + "/health_generate")
                        foreign["health"] += 1
                    else:
                        # Same lengths as our samples, other ids: only an ids check tells them apart.
                        n = len(rng.choice(samples)["input_ids"])
                        c.post(
                            url + "/generate",
                            json={
                                "input_ids": [rng.randrange(VOCAB) for _ in range(n)],
                                "sampling_params": {"max_new_tokens": 0},
                            },
                        )
                        foreign["generate"] += 1
                except httpx.HTTPError:
                    time.sleep(0.05)

    # The server boots after the job was queued: its warm-up dump lands in the root the service owns.
    ref = start_reference(tmp_path, checkpoint, dump_root=dump_root, port=port)
    worker = threading.Thread(target=traffic, args=(ref.url,), daemon=True)
    try:
        worker.start()
        job = svc.wait_job(job_id)
        stop.set()
        worker.join(timeout=30)
        assert foreign["health"] > 0 and foreign["generate"] > 0
        assert_stored_exactly(svc, job, samples, recompute)
        details = [svc.get(f"/v1/jobs/{job_id}/samples/{s['id']}").json() for s in samples]
        assert all(d["observed_tokens"] == d["expected_tokens"] for d in details)
        print(json.dumps({"foreign": foreign, "attempts": sum(d["attempts"] for d in details)}))
    finally:
        stop.set()
        svc.stop()
        ref.stop()

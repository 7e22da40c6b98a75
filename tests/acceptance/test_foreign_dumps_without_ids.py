"""A counter-naming server whose dumps carry neither input ids nor a rid, with foreign traffic of the
same length: hsx stores no foreign tensor, whatever order the dumps complete in.

The reference server (`--anonymous-dumps`, fault injection) writes dumps as older patched servers
do, and puts a foreign dump of the sample's length next to ours in the three orders that defeat a
reader that takes the first completed dump of the right size:

- ours written before the reply but its `done` 0.1 s late, a foreign one completed before it;
- ours complete, a foreign one written just after the reply (an asynchronous client);
- ours written after the reply (an asynchronous writer), a foreign one completed before it.

Every stored sample is checked against the synthetic recomputation of its own ids (a foreign
dump's rows come from other ids, so any one stored would differ), on SQLite and on Postgres.
"""

from __future__ import annotations

import random

import httpx
import pytest
import torch

from hsx.manifest import load_manifest, read_sample
from hsx.reference.synthetic import synthetic_hidden_states
from tests.support.procs import start_synthetic
from tests.support.stack import start_service

HIDDEN, NUM_LAYERS, VOCAB = 32, 8, 1000
LAYERS = [2, 4, 5, 8]
TOKENS = 12  # every sample and every foreign dump the same length: only the order can tell them apart
PER_ORDER = 100

ORDERS = {
    "own done late, foreign done first": {
        "late_done": {"probability": 0.3, "seconds": 0.1},
        "foreign_dumps": {"probability": 0.3, "before": 0, "after": 1},
    },
    "foreign dump just after the reply": {
        "foreign_dumps": {"probability": 0.3, "before": 0, "after": 1, "after_reply_s": 0.01},
    },
    "own dump after the reply": {
        "late_dump": {"probability": 0.3, "seconds": 0.01},
        "foreign_dumps": {"probability": 0.3, "before": 1, "after": 0},
    },
}


@pytest.fixture
def anonymous_server(tmp_path):
    proc, url = start_synthetic(
        tmp_path,
        hidden=HIDDEN,
        num_layers=NUM_LAYERS,
        vocab=VOCAB,
        dump_root=tmp_path / "dumps",
        extra=["--anonymous-dumps", "--enable-fault-injection", "--skip-server-warmup"],
    )
    yield url
    proc.stop()


def test_no_foreign_dump_is_stored_in_any_order_of_completion(tmp_path, database_url, anonymous_server):
    url = anonymous_server
    svc = start_service(
        tmp_path,
        database_url,
        backend_url=url,
        dump_root=tmp_path / "dumps",
        extra=["--dump-wait-s", "5", "--max-attempts", "10", "--flushers", "2"],
    )
    try:
        rng = random.Random(23)
        for n, (order, faults) in enumerate(ORDERS.items()):
            httpx.delete(url + "/admin/faults").raise_for_status()
            httpx.post(url + "/admin/faults", json={"seed": n, **faults}).raise_for_status()
            items = [
                {"id": f"o{n}-{i}", "input_ids": [rng.randrange(VOCAB) for _ in range(TOKENS)]}
                for i in range(PER_ORDER)
            ]
            job = svc.wait_job(svc.post_job({"samples": items}).json()["id"], timeout=300)
            injected = httpx.get(url + "/admin/faults").json()["injected"]
            assert injected["foreign_dump"] >= PER_ORDER // 5, (order, injected)
            assert job["state"] == "succeeded", (order, job)
            folder = svc.output_root / job["id"]
            manifest = load_manifest(folder)
            assert manifest.identity == "count" and {s.identity for s in manifest.samples} == {"count"}
            for s in items:
                got = read_sample(folder, manifest, s["id"])
                truth = synthetic_hidden_states(s["input_ids"], LAYERS, HIDDEN, torch.bfloat16)
                for i in LAYERS:
                    assert torch.equal(got[f"layer_{i}"], truth[i]), (order, s["id"], i)
            reasons = [
                a["reason"]
                for s in items
                for a in svc.get(f"/v1/jobs/{job['id']}/samples/{s['id']}").json()["attempt_log"]
                if a["outcome"] != "ok"
            ]
            # The hazard happened, and was refused as such rather than guessed through.
            assert any(r.startswith("ambiguous") for r in reasons), (order, reasons[:5])
        health = svc.get("/healthz").json()
        assert health["writer"]["server"]["identity"] == "count"
        assert "identity: count" in svc.proc.log(), "the weak proof is warned about"
    finally:
        svc.stop()

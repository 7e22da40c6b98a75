"""Faults a real server produces, switched on in the reference server: foreign dumps, late or missing
`done`, every kind of bad dump, and server settings that would make dumps partial."""

from __future__ import annotations

import random
import time

import httpx
import pytest
import torch

from hsx.manifest import load_manifest, read_sample
from hsx.reference.synthetic import synthetic_hidden_states
from hsx.storage.shards import shard_name
from tests.support.procs import start_synthetic as synthetic_server
from tests.support.stack import start_service

HIDDEN, NUM_LAYERS, VOCAB = 64, 8, 1000
LAYERS = [2, 4, 5, 8]


def start_synthetic(tmp, *extra: str):
    return synthetic_server(
        tmp,
        hidden=HIDDEN,
        num_layers=NUM_LAYERS,
        vocab=VOCAB,
        dump_root=tmp / "dumps",
        extra=["--enable-fault-injection", *extra],
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("inject")
    proc, url = start_synthetic(tmp)
    svc = start_service(
        tmp,
        f"sqlite:///{tmp / 'hsx.db'}",
        backend_url=url,
        dump_root=tmp / "dumps",
        extra=["--dump-wait-s", "3", "--max-attempts", "3", "--flushers", "2"],
    )
    yield svc, url
    svc.stop()
    proc.stop()


def faults(url: str, patch: dict | None) -> dict:
    """Apply a settings patch; None resets everything. Returns the state before a reset."""
    if patch is None:
        before = httpx.get(url + "/admin/faults").json()
        httpx.delete(url + "/admin/faults")
        return before
    return httpx.post(url + "/admin/faults", json=patch).json()


def samples(n: int, seed: int, lengths: list[int] | None = None) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "id": f"f{seed}-{i}",
            "input_ids": [rng.randrange(VOCAB) for _ in range(lengths[i] if lengths else rng.randint(3, 60))],
        }
        for i in range(n)
    ]


def run_job(svc, items: list[dict]) -> dict:
    return svc.wait_job(svc.post_job({"samples": items}).json()["id"], timeout=240)


def assert_exact(svc, job: dict, items: list[dict]) -> None:
    manifest = load_manifest(svc.output_root / job["id"])
    assert [s.id for s in manifest.samples] == [s["id"] for s in items]
    # a shard that could not be written (a sample with NaN or Inf) gives its number to the next one
    assert sorted(s.name for s in manifest.shards) == [shard_name(n) for n in range(len(manifest.shards))]
    assert [s.seq for s in manifest.shards] == list(range(1, len(manifest.shards) + 1))  # the order recorded
    for s in items:
        got = read_sample(svc.output_root / job["id"], manifest, s["id"])
        truth = synthetic_hidden_states(s["input_ids"], LAYERS, HIDDEN, torch.bfloat16)
        assert got["input_ids"].tolist() == s["input_ids"]
        for i in LAYERS:
            assert torch.equal(got[f"layer_{i}"], truth[i]), (s["id"], i)


def attempts(svc, job_id: str, sample_id: str) -> list[dict]:
    return svc.get(f"/v1/jobs/{job_id}/samples/{sample_id}").json()["attempt_log"]


def test_foreign_dumps_of_the_same_length_around_every_request(stack):
    svc, url = stack
    faults(url, None)
    # Every sample the same length, so only ids tell a foreign dump from ours.
    items = samples(8, seed=1, lengths=[17] * 8)
    faults(url, {"foreign_dumps": {"count": 8, "before": 2, "after": 2}})
    job = run_job(svc, items)
    state = faults(url, None)
    assert state["injected"].get("foreign_dump", 0) >= 16
    assert job["state"] == "succeeded"
    assert_exact(svc, job, items)
    assert all(len(attempts(svc, job["id"], s["id"])) == 1 for s in items), "foreign dumps cost no attempt"


def test_late_done_and_a_dump_that_never_completes(stack):
    svc, url = stack
    faults(url, None)
    faults(url, {"late_done": {"count": 3, "seconds": 0.7}})
    items = samples(3, seed=2)
    job = run_job(svc, items)
    assert job["state"] == "succeeded"
    assert_exact(svc, job, items)
    assert all(len(attempts(svc, job["id"], s["id"])) == 1 for s in items), "a late marker is waited for"

    faults(url, {"late_done": {"count": 1, "never": True}})
    items = samples(2, seed=3)
    job = run_job(svc, items)
    assert job["state"] == "succeeded"
    assert_exact(svc, job, items)
    log = attempts(svc, job["id"], items[0]["id"])
    assert [a["outcome"] for a in log] == ["retry", "ok"] and log[0]["reason"].startswith("incomplete")


def test_a_dump_lost_with_its_server_spends_no_attempt(stack):
    """The server answers, then goes away before its dump is complete (killed after its reply): the
    dump never comes, and the sample goes back unspent, to be sent again once the server is back."""
    svc, url = stack
    faults(url, None)
    faults(url, {"late_done": {"count": 1, "never": True}})
    items = samples(1, seed=5)
    job_id = svc.post_job({"samples": items}).json()["id"]
    deadline = time.monotonic() + 60
    while httpx.get(url + "/admin/faults").json()["injected"].get("never_done", 0) == 0:
        assert time.monotonic() < deadline, "the sample was never sent"
        time.sleep(0.05)
    faults(url, {"unavailable": {"seconds": 6}})  # down before the 3 s the dump is waited for run out
    job = svc.wait_job(job_id, timeout=120)
    assert job["state"] == "succeeded"
    assert_exact(svc, job, items)
    log = attempts(svc, job_id, items[0]["id"])
    assert [a["outcome"] for a in log] == ["interrupted", "ok"]
    assert "model server unavailable" in log[0]["reason"] and "(incomplete)" in log[0]["reason"]
    assert svc.get(f"/v1/jobs/{job_id}/samples/{items[0]['id']}").json()["attempts"] == 1


EXPECTED = {
    "missing_layer": "missing_layer",
    "truncated": "bad_tensor_file",
    "unreadable": "bad_tensor_file",
    "wrong_shape": "wrong_shape",
    "wrong_dtype": "wrong_dtype",
    "nan": "non_finite",
    "inf": "non_finite",
    "cached_tokens": "cached_tokens",
    "wrong_num_tokens": "no_dump",
    "wrong_ids": "no_dump",
    "missing_meta_field": "no_dump",
    "bad_meta_json": "no_dump",
    # counter-named dumps: the finder skips a dump whose meta is bad, saying why
    "duplicate_layer": "no_dump",
}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
def test_each_bad_dump_is_retried_with_its_reason(stack, kind):
    svc, url = stack
    faults(url, None)
    faults(url, {"bad_dumps": {"count": 1, "kind": kind}})
    items = samples(1, seed=hash(kind) % 1000)
    job = run_job(svc, items)
    injected = {k: v for k, v in faults(url, None)["injected"].items() if v}
    assert injected == {f"bad_dump.{kind}": 1}
    assert job["state"] == "succeeded"
    assert_exact(svc, job, items)
    log = attempts(svc, job["id"], items[0]["id"])
    assert [a["outcome"] for a in log] == ["retry", "ok"], log
    assert log[0]["reason"].split(":")[0] == EXPECTED[kind], log[0]["reason"]
    if kind == "duplicate_layer":
        assert f"lists layers {LAYERS + LAYERS[-1:]}" in log[0]["reason"], log[0]["reason"]


def test_bad_dumps_past_the_budget_fail_the_sample_and_store_nothing(stack):
    svc, url = stack
    faults(url, None)
    faults(url, {"bad_dumps": {"probability": 1.0, "kind": "nan"}})
    items = samples(2, seed=4)
    job = run_job(svc, items)
    faults(url, None)
    assert job["state"] == "failed" and job["counts"]["failed"] == 2 and job["counts"]["succeeded"] == 0
    manifest = load_manifest(svc.output_root / job["id"])
    assert manifest.samples == [] and manifest.shards == []
    for s in items:
        sample = svc.get(f"/v1/jobs/{job['id']}/samples/{s['id']}").json()
        assert sample["state"] == "failed" and sample["attempts"] == 3
        assert sample["last_error"].startswith("non_finite")


def test_unavailable_server_costs_no_attempt(stack):
    svc, url = stack
    faults(url, None)
    faults(url, {"unavailable": {"seconds": 3}})
    items = samples(3, seed=5)
    job = run_job(svc, items)
    assert job["state"] == "succeeded"
    assert_exact(svc, job, items)
    assert all(svc.get(f"/v1/jobs/{job['id']}/samples/{s['id']}").json()["attempts"] == 1 for s in items)


def test_chunked_prefill_is_refused(tmp_path):
    proc, url = start_synthetic(tmp_path, "--chunked-prefill-size", "16")
    svc = start_service(tmp_path, f"sqlite:///{tmp_path / 'hsx.db'}", backend_url=url, dump_root=tmp_path / "dumps")
    try:
        job_id = svc.post_job({"samples": samples(2, seed=6, lengths=[40, 40])}).json()["id"]
        deadline = time.monotonic() + 60
        job = svc.get(f"/v1/jobs/{job_id}").json()
        while not job["waiting_reason"] and time.monotonic() < deadline:
            time.sleep(0.2)
            job = svc.get(f"/v1/jobs/{job_id}").json()
        assert "--chunked-prefill-size -1" in job["waiting_reason"], job
        time.sleep(1)
        job = svc.get(f"/v1/jobs/{job_id}").json()
        assert job["counts"]["queued"] == 2 and job["tokens"]["done"] == 0, "nothing partial is stored"
        health = svc.get("/healthz").json()
        assert health["status"] == "degraded" and health["writer"]["state"] == "refusing"
    finally:
        svc.stop()
        proc.stop()


def test_a_prefix_cache_serves_nothing_to_requests_with_their_own_extra_key(tmp_path):
    """Every request carries a unique extra_key, which namespaces the server's prefix cache: prompts
    that extend earlier ones are still computed whole, at the first attempt."""
    proc, url = start_synthetic(tmp_path, "--enable-radix-cache")
    svc = start_service(tmp_path, f"sqlite:///{tmp_path / 'hsx.db'}", backend_url=url, dump_root=tmp_path / "dumps")
    try:
        items = samples(4, seed=7, lengths=[30] * 4)
        items += [{"id": f"longer-{i}", "input_ids": s["input_ids"] + [5, 6]} for i, s in enumerate(items)]
        job = run_job(svc, items)
        assert job["state"] == "succeeded"
        assert_exact(svc, job, items)
        assert all(len(attempts(svc, job["id"], s["id"])) == 1 for s in items)
    finally:
        svc.stop()
        proc.stop()


@pytest.mark.parametrize("flushers", [1, 2])
def test_a_job_ends_with_full_shards_and_one_small_one(tmp_path, flushers):
    """Once nothing is left to claim, the staged samples wait for the last request (0.2 s here) instead
    of going to a shard without it: 24 samples, five to a shard, end as four full shards and one of four,
    however many flushers write them."""
    proc, url = start_synthetic(tmp_path, "--prefill-us-per-token", "5000")
    sample_bytes = 40 * HIDDEN * len(LAYERS) * 2  # 40 tokens of bfloat16
    svc = start_service(
        tmp_path,
        f"sqlite:///{tmp_path / 'hsx.db'}",
        backend_url=url,
        dump_root=tmp_path / "dumps",
        extra=["--shard-max-wait-s", "600", "--shard-max-bytes", str(5 * sample_bytes), "--flushers", str(flushers)],
    )
    try:
        items = samples(24, seed=9, lengths=[40] * 24)
        job = run_job(svc, items)
        assert job["state"] == "succeeded"
        assert_exact(svc, job, items)
        manifest = load_manifest(svc.output_root / job["id"])
        assert sorted(sh.num_samples for sh in manifest.shards) == [4, 5, 5, 5, 5]
    finally:
        svc.stop()
        proc.stop()

"""The output root with real processes: shard numbers stay contiguous through failed writes, services
that share a database share one output root (or refuse to start), and a shard file gone from the
output root is a 410 problem, never a 500."""

from __future__ import annotations

import hashlib
import time

import pytest

from hsx.sdk import Gone, HsxClient
from hsx.storage.output_root import MARKER_NAME
from hsx.storage.shards import shard_name
from tests.support.procs import free_port
from tests.support.samples import assert_stored_exactly, make_samples
from tests.support.stack import start_reference, start_service


def wait_for(predicate, timeout: float = 120.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"{what} not reached within {timeout}s")


def gone(resp, *names: str) -> dict:
    assert resp.status_code == 410, resp.text
    assert resp.headers["content-type"].startswith("application/problem+json")
    problem = resp.json()
    assert problem["status"] == 410 and problem["type"] == "/problems/shard-missing"
    assert problem["missing_shards"] == list(names) and names[0] in problem["detail"]
    return problem


def test_failed_shard_writes_leave_no_gap_in_shard_numbers(tmp_path, database_url, checkpoint, recompute):
    port, dump_root = free_port(), tmp_path / "dumps"
    # No model server yet: the job waits, so its folder can be blocked before any shard is written.
    svc = start_service(
        tmp_path,
        database_url,
        backend_url=f"http://127.0.0.1:{port}",
        dump_root=dump_root,
        extra=["--shard-max-bytes", "40000", "--shard-max-wait-s", "0.2"],
    )
    ref = None
    try:
        samples = make_samples(12, seed=60, lo=30, hi=70)
        job_id = svc.post_job({"samples": samples}).json()["id"]
        blocker = svc.output_root / job_id
        blocker.write_text("a file where the job's folder should be: every shard write fails (EEXIST)")
        ref = start_reference(tmp_path, checkpoint, dump_root=dump_root, port=port)
        wait_for(lambda: svc.proc.log().count("writing a shard failed") >= 5, what="five failed shard writes")
        assert svc.get(f"/v1/jobs/{job_id}").json()["counts"]["succeeded"] == 0
        blocker.unlink()
        job = svc.wait_job(job_id)
        manifest = assert_stored_exactly(svc, job, samples, recompute)
        names = sorted(s.name for s in manifest.shards)  # listed in the order recorded: flushers race
        assert len(names) >= 2 and names == [shard_name(n) for n in range(len(names))], names
        assert [s.seq for s in manifest.shards] == list(range(1, len(names) + 1))
        assert job["shards_written"] == len(names)
    finally:
        svc.stop()
        if ref is not None:
            ref.stop()


def test_writes_wait_while_the_output_root_is_gone(tmp_path, checkpoint, recompute):
    """As when a network file system drops away: nothing is written where the root was, extraction
    waits with the reason, and goes on once the folder is back."""
    port, dump_root = free_port(), tmp_path / "dumps"
    svc = start_service(
        tmp_path,
        f"sqlite:///{tmp_path / 'hsx.db'}",
        backend_url=f"http://127.0.0.1:{port}",
        dump_root=dump_root,
        extra=["--shard-max-bytes", "40000"],
    )
    ref = None
    try:
        samples = make_samples(8, seed=63, lo=30, hi=60)
        job_id = svc.post_job({"samples": samples}).json()["id"]
        away = tmp_path / "unmounted"
        svc.output_root.rename(away)
        ref = start_reference(tmp_path, checkpoint, dump_root=dump_root, port=port)
        reason = wait_for(
            lambda: "output root" in (r := svc.get(f"/v1/jobs/{job_id}").json()["waiting_reason"] or "") and r,
            what="waiting for the output root",
        )
        assert "output root unavailable" in reason and f"holds no {MARKER_NAME}" in reason, reason
        assert svc.get(f"/v1/jobs/{job_id}").json()["counts"]["succeeded"] == 0
        assert not svc.output_root.exists(), "nothing is written where the output root was"
        away.rename(svc.output_root)
        job = svc.wait_job(job_id)
        assert_stored_exactly(svc, job, samples, recompute)
    finally:
        svc.stop()
        if ref is not None:
            ref.stop()


def test_a_shard_file_gone_from_the_output_root_is_410(tmp_path, database_url, checkpoint):
    ref = start_reference(tmp_path, checkpoint)
    svc = start_service(
        tmp_path, database_url, backend_url=ref.url, dump_root=ref.dump_root, extra=["--shard-max-bytes", "30000"]
    )
    try:
        samples = make_samples(8, seed=61, lo=30, hi=60)
        job = svc.wait_job(svc.post_job({"samples": samples}).json()["id"])
        assert job["state"] == "succeeded"
        manifest = svc.get(f"/v1/jobs/{job['id']}/manifest").json()
        assert len(manifest["shards"]) >= 2
        lost, kept = manifest["shards"][0]["name"], manifest["shards"][1]["name"]
        in_lost = next(s["id"] for s in manifest["samples"] if s["shard"] == lost)
        in_kept = next(s["id"] for s in manifest["samples"] if s["shard"] == kept)
        (svc.output_root / job["id"] / lost).unlink()

        gone(svc.get(f"/v1/jobs/{job['id']}/shards/{lost}"), lost)
        gone(svc.get(f"/v1/jobs/{job['id']}/shards/{lost}", headers={"Range": "bytes=0-99"}), lost)
        gone(svc.get(f"/v1/jobs/{job['id']}/manifest"), lost)
        gone(svc.get(f"/v1/jobs/{job['id']}/tensors/{in_lost}"), lost)
        with pytest.raises(Gone) as err, HsxClient(svc.url) as client:
            client.manifest(job["id"])
        assert err.value.problem["missing_shards"] == [lost]
        # what is still there is still served
        download = svc.get(f"/v1/jobs/{job['id']}/shards/{kept}")
        assert download.status_code == 200
        assert hashlib.sha256(download.content).hexdigest() == manifest["shards"][1]["sha256"]
        assert svc.get(f"/v1/jobs/{job['id']}/tensors/{in_kept}").status_code == 200
        report = svc.client.post(f"{svc.url}/v1/jobs/{job['id']}/verify")
        assert report.status_code == 200 and report.json()["ok"] is False
    finally:
        svc.stop()
        ref.stop()


@pytest.mark.postgres
def test_services_sharing_a_database_share_one_output_root(tmp_path, postgres_url, checkpoint, recompute):
    for host in "abc":
        (tmp_path / host).mkdir()
    ref_a = start_reference(tmp_path / "a", checkpoint)
    svc_a = start_service(
        tmp_path / "a",
        postgres_url,
        backend_url=ref_a.url,
        dump_root=ref_a.dump_root,
        extra=["--shard-max-bytes", "30000"],
    )
    ref_b = svc_b = None
    try:
        shared = svc_a.output_root
        assert (shared / MARKER_NAME).is_file()

        # A second service with its own output root: an empty folder, then one another database marked.
        refused = start_service(tmp_path / "b", postgres_url, dump_root=tmp_path / "b" / "dumps", wait=False)
        assert refused.proc.proc.wait(timeout=60) == 2
        assert f"holds no {MARKER_NAME}" in refused.proc.log() and "share one output root" in refused.proc.log()
        assert not (tmp_path / "b" / "output" / MARKER_NAME).exists(), "a refused folder is left unmarked"
        elsewhere = start_service(tmp_path / "c", f"sqlite:///{tmp_path / 'c.db'}", dump_root=tmp_path / "c" / "d1")
        elsewhere.stop()
        refused = start_service(tmp_path / "c", postgres_url, dump_root=tmp_path / "c" / "d2", wait=False)
        assert refused.proc.proc.wait(timeout=60) == 2
        assert "is marked" in refused.proc.log() and str(shared.resolve()) in refused.proc.log()

        # The same folder: both writers store shards of one job side by side, and either serves them all.
        ref_b = start_reference(tmp_path / "b", checkpoint)
        svc_b = start_service(
            tmp_path / "b",
            postgres_url,
            backend_url=ref_b.url,
            dump_root=ref_b.dump_root,
            extra=["--output-root", str(shared), "--shard-max-bytes", "30000"],
        )
        svc_b.output_root = shared
        for svc in (svc_a, svc_b):
            wait_for(lambda svc=svc: svc.get("/healthz").json()["status"] == "ok", what="writer ready")
        samples = make_samples(40, seed=62, lo=20, hi=60)
        job = svc_a.wait_job(svc_a.post_job({"samples": samples}).json()["id"])
        manifest = assert_stored_exactly(svc_a, job, samples, recompute)
        boots = {
            a["boot_id"]
            for s in samples
            for a in svc_a.get(f"/v1/jobs/{job['id']}/samples/{s['id']}").json()["attempt_log"]
            if a["outcome"] == "ok"
        }
        assert len(boots) == 2, "both model servers' writers stored samples of the job"
        assert svc_b.get(f"/v1/jobs/{job['id']}/manifest").json() == svc_a.get(f"/v1/jobs/{job['id']}/manifest").json()
        for shard in manifest.shards:
            for svc in (svc_a, svc_b):
                resp = svc.get(f"/v1/jobs/{job['id']}/shards/{shard.name}")
                assert resp.status_code == 200, resp.text
                assert hashlib.sha256(resp.content).hexdigest() == shard.sha256
    finally:
        for part in (svc_b, ref_b, svc_a, ref_a):
            if part is not None:
                part.stop()

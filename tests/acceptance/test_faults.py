"""Faults injected for real: the model server killed or down, the service SIGKILLed, stale dumps,
the output disk full, Postgres restarted. Every sample ends stored with its own tensors, once."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import threading
import time

import pytest

from hsx.sdk import HsxClient, Unavailable
from tests.support.procs import free_port
from tests.support.samples import assert_stored_exactly, make_samples
from tests.support.stack import start_reference, start_service


def wait_for(predicate, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"{what} not reached within {timeout}s")


def started(svc, job_id: str, n: int = 1) -> bool:
    c = svc.get(f"/v1/jobs/{job_id}").json()["counts"]
    return c["staged"] + c["succeeded"] >= n


def attempt_log(svc, job_id: str, samples) -> list[dict]:
    return [a for s in samples for a in svc.get(f"/v1/jobs/{job_id}/samples/{s['id']}").json()["attempt_log"]]


def test_model_server_killed_and_restarted_mid_job(tmp_path, checkpoint, recompute):
    port = free_port()
    dump_root = tmp_path / "dumps"
    ref = start_reference(tmp_path, checkpoint, dump_root=dump_root, port=port)
    svc = start_service(tmp_path, f"sqlite:///{tmp_path / 'hsx.db'}", backend_url=ref.url, dump_root=dump_root)
    try:
        samples = make_samples(24, seed=40, lo=40, hi=120)
        job_id = svc.post_job({"samples": samples}).json()["id"]
        wait_for(lambda: started(svc, job_id, 3), what="first samples")
        ref.proc.kill()  # SIGKILL: the in-flight request is lost, the counter will restart at 0
        waiting = wait_for(lambda: svc.get(f"/v1/jobs/{job_id}").json()["waiting_reason"], what="waiting reason")
        assert "model server not ready" in waiting
        time.sleep(2)  # down for a while: attempts must not burn meanwhile
        ref = start_reference(tmp_path, checkpoint, dump_root=dump_root, port=port)
        job = svc.wait_job(job_id)
        assert_stored_exactly(svc, job, samples, recompute)
        log = attempt_log(svc, job_id, samples)
        assert all(a["outcome"] in ("ok", "interrupted", "retry") for a in log)
        assert len({a["boot_id"] for a in log if a["outcome"] == "ok"}) == 2, "dumps from both server lifetimes"
        assert all(
            s["attempts"] == 1 for s in svc.get(f"/v1/jobs/{job_id}/samples", params={"limit": 100}).json()["data"]
        ), "an outage must not spend attempts"
    finally:
        svc.stop()
        ref.stop()


def test_stale_dumps_left_in_the_root(tmp_path, checkpoint, recompute):
    """Dumps from before the service started, including one with exactly a sample's ids and token
    count but other tensors, must never be stored."""
    dump_root = tmp_path / "dumps"
    samples = make_samples(6, seed=41)
    ref = start_reference(tmp_path, checkpoint, dump_root=dump_root)
    # A real dump of sample 0's ids from another model lifetime: copy it, then poison its tensors.
    import httpx

    httpx.post(
        ref.url + "/generate", json={"input_ids": samples[0]["input_ids"], "sampling_params": {"max_new_tokens": 0}}
    )
    stale = max(dump_root.glob("req_*"), key=lambda p: int(p.name[4:]))
    poisoned = dump_root / "req_999999"
    shutil.copytree(stale, poisoned)
    from safetensors.torch import load_file, save_file

    tensors = {k: v * 0 + 1 for k, v in load_file(poisoned / "hidden_states.safetensors").items()}
    save_file(tensors, poisoned / "hidden_states.safetensors")
    svc = start_service(tmp_path, f"sqlite:///{tmp_path / 'hsx.db'}", backend_url=ref.url, dump_root=dump_root)
    try:
        job = svc.wait_job(svc.post_job({"samples": samples}).json()["id"])
        assert_stored_exactly(svc, job, samples, recompute)
    finally:
        svc.stop()
        ref.stop()


def test_service_sigkilled_at_random_moments(tmp_path, checkpoint, recompute, database_url):
    dump_root = tmp_path / "dumps"
    ref = start_reference(tmp_path, checkpoint, dump_root=dump_root)
    samples = make_samples(30, seed=42, lo=20, hi=90)
    rng = random.Random(5)
    svc = start_service(
        tmp_path, database_url, backend_url=ref.url, dump_root=dump_root, extra=["--shard-max-bytes", "60000"]
    )
    try:
        job_id = svc.post_job({"samples": samples}).json()["id"]
        kills = 0
        for _ in range(5):
            time.sleep(rng.uniform(0.3, 2.5))
            svc.proc.kill()
            kills += 1
            svc = start_service(
                tmp_path, database_url, backend_url=ref.url, dump_root=dump_root, extra=["--shard-max-bytes", "60000"]
            )
            if svc.get(f"/v1/jobs/{job_id}").json()["state"] == "succeeded":
                break
        job = svc.wait_job(job_id)
        manifest = assert_stored_exactly(svc, job, samples, recompute)
        named = {s.name for s in manifest.shards}
        on_disk = {p.name for p in (svc.output_root / job_id).iterdir()}
        assert on_disk == named | {"manifest.json"}, "no partial or orphaned file may be left"
        assert sum(s.num_samples for s in manifest.shards) == len(samples), "no sample stored twice"
        assert kills >= 1
    finally:
        svc.stop()
        ref.stop()


def _mount_tmpfs(path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
    )
    return result.returncode == 0


def test_output_disk_full_pauses_then_resumes(tmp_path, checkpoint, recompute):
    out = tmp_path / "small-disk"
    if not _mount_tmpfs(out, "2m"):
        if os.environ.get("CI"):
            pytest.fail("could not mount a small tmpfs for the disk-full test")
        pytest.skip("mounting a tmpfs needs root")
    try:
        filler = out / "filler"
        with open(filler, "wb") as f:  # leave about 100 KB free
            f.write(b"\0" * (2 * 1024 * 1024 - 100 * 1024))
        ref = start_reference(tmp_path, checkpoint)
        svc = start_service(
            tmp_path,
            f"sqlite:///{tmp_path / 'hsx.db'}",
            backend_url=ref.url,
            dump_root=ref.dump_root,
            extra=["--output-root", str(out), "--shard-max-bytes", "50000", "--disk-check", "off"],
        )
        svc.output_root = out
        try:
            # The writer ready first: a job posted while it still starts would wait for that, not for the disk.
            svc.proc.wait_http(svc.url + "/healthz", ok=lambda r: r.json().get("status") == "ok")
            samples = make_samples(12, seed=43, lo=60, hi=120)
            job_id = svc.post_job({"samples": samples}).json()["id"]
            reason = wait_for(
                lambda: svc.get(f"/v1/jobs/{job_id}").json()["waiting_reason"], timeout=120, what="disk-full pause"
            )
            assert "disk full" in reason
            assert not list((out / job_id).glob(".*tmp*")) if (out / job_id).exists() else True
            paused = svc.get(f"/v1/jobs/{job_id}").json()
            assert paused["state"] == "running" and paused["counts"]["failed"] == 0
            filler.unlink()
            job = svc.wait_job(job_id)
            assert_stored_exactly(svc, job, samples, recompute)
        finally:
            svc.stop()
            ref.stop()
    finally:
        subprocess.run(["umount", "-l", str(out)], check=False)


@pytest.mark.postgres
def test_postgres_restarted_mid_job(tmp_path, checkpoint, recompute, postgres_url):
    ref = start_reference(tmp_path, checkpoint)
    svc = start_service(tmp_path, postgres_url, backend_url=ref.url, dump_root=ref.dump_root)
    try:
        samples = make_samples(20, seed=44, lo=40, hi=100)
        job_id = svc.post_job({"samples": samples}).json()["id"]
        wait_for(lambda: started(svc, job_id, 3), what="first samples")
        version = os.listdir("/etc/postgresql")[0]
        ctl = ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main"]
        subprocess.run([*ctl, "stop"], check=True)
        restart = threading.Timer(3.0, subprocess.run, args=([*ctl, "start"],), kwargs={"check": True})
        try:
            down = svc.client.get(f"{svc.url}/v1/jobs/{job_id}")
            assert down.status_code == 503 and down.headers["retry-after"], down.text
            assert down.headers["content-type"].startswith("application/problem+json")
            assert "database unavailable" in down.json()["detail"]
            with pytest.raises(Unavailable):
                HsxClient(svc.url).get_job(job_id)
            restart.start()
            # The SDK's wait() polls through the outage and returns the finished job.
            assert HsxClient(svc.url).wait(job_id, timeout=240, poll_s=0.2).state == "succeeded"
        finally:
            restart.cancel()
            if restart.ident is not None:
                restart.join()
            if subprocess.run(["pg_isready", "-h", "127.0.0.1", "-q"]).returncode != 0:
                subprocess.run([*ctl, "start"], check=True)
        job = svc.wait_job(job_id, timeout=240)
        assert_stored_exactly(svc, job, samples, recompute)
        assert "database unavailable" in svc.proc.log() or job["state"] == "succeeded"
    finally:
        svc.stop()
        ref.stop()


def test_disk_planning_refuses_or_warns_at_creation(tmp_path, checkpoint):
    out = tmp_path / "tiny-disk"
    if not _mount_tmpfs(out, "1m"):
        if os.environ.get("CI"):
            pytest.fail("could not mount a small tmpfs for the disk-planning test")
        pytest.skip("mounting a tmpfs needs root")
    ref = start_reference(tmp_path, checkpoint)
    try:
        per_token = 4 * 48 * 2 + 16  # four bf16 layers of hidden 48, plus int64 ids and mask
        big = {"samples": [{"input_ids": [1] * 500} for _ in range(6)]}  # 3,000 tokens: ~1.2 MB > 1 MiB
        for mode, expect in (("refuse", 507), ("warn", 202)):
            svc = start_service(
                tmp_path / mode,
                f"sqlite:///{tmp_path / mode}.db",
                backend_url=ref.url,
                dump_root=tmp_path / mode / "dumps",
                extra=["--output-root", str(out), "--disk-check", mode, "--no-writer"],
            )
            try:
                small = svc.post_job({"samples": [{"input_ids": [1, 2, 3]}]}).json()
                assert small["estimated_bytes"] == 3 * per_token and small["disk_warning"] is None
                resp = svc.post_job(big)
                assert resp.status_code == expect, resp.text
                if mode == "refuse":
                    problem = resp.json()
                    assert problem["needed_bytes"] == 3000 * per_token and problem["free_bytes"] <= 1024 * 1024
                    assert len(svc.get("/v1/jobs").json()["data"]) == 1, "a refused job stores nothing"
                else:
                    assert "output volume" in resp.json()["disk_warning"]
            finally:
                svc.stop()
    finally:
        ref.stop()
        subprocess.run(["umount", "-l", str(out)], check=False)

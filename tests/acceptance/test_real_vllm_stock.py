"""Jobs against a real vLLM 0.32.0 (its CPU build) writing vLLM's own connector's files, with nothing of hsx's in
the dump root: `hsx serve --source vllm --capture-layers 2,4,5,8` takes the layers from the operator, the model
from /v1/models and config.json, restarts from /metrics' process_start_time_seconds; every stored tensor is
proven by its file's token ids and equal to a transformers recomputation.

vLLM's `ExampleHiddenStatesConnector` itself cannot run here: on a CPU-only host its copy out of the KV cache
(CUDA stream, CUDA event, pinned memory) kills the engine at the first finished request (`pin_memory=True
requires a CUDA or other accelerator backend`). The server runs deploy/vllm's `CpuCopyConnector` instead: vLLM's
class with only that copy swapped for a synchronous one on the CPU. File names, places, contents and the lock
handshake are vLLM's own, and no hsx-vllm.json is written, as with the stock connector on a GPU."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.real_vllm import (
    EAGLE3_LAYERS,
    STOCK_ON_CPU,
    VLLM,
    VLLMS_OWN,
    ReadmeLaunch,
    ReadmeVLLM,
    items,
    largest_difference,
    tiny_model,
    vllm_python,
)
from tests.support.stack import Service, start_service

pytestmark = pytest.mark.slow  # one real vLLM for the module: 30-95 s to start, and a restart

LAYERS = EAGLE3_LAYERS
# What deploy/vllm/README.md's "On a CPU host" block tells hsx; the server runs that block's command as written.
CAPTURE = ",".join(map(str, ReadmeLaunch.read().capture_layers))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    return tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model: tuple[Path, torch.nn.Module]) -> Iterator[VLLM]:
    tmp = tmp_path_factory.mktemp("vllm")
    s = ReadmeVLLM(vllm_python(), tmp, model[0], LAYERS, tmp / "dumps", connector=STOCK_ON_CPU).start()
    yield s
    s.stop()


def service(tmp_path: Path, server: VLLM, *extra: str) -> Service:
    return start_service(
        tmp_path,
        f"sqlite:///{tmp_path / 'hsx.db'}",
        backend_url=server.url,
        dump_root=server.storage,
        extra=["--max-in-flight", "4", *extra],
    )


def wait_reason(svc: Service, job: dict) -> dict:
    deadline = time.monotonic() + 60
    while not job["waiting_reason"] and time.monotonic() < deadline:
        time.sleep(0.2)
        job = svc.get(f"/v1/jobs/{job['id']}").json()
    return job


def test_without_capture_layers_the_writer_refuses_and_says_what_to_give(tmp_path, server):
    svc = service(tmp_path, server, "--source", "vllm")
    try:
        job = wait_reason(svc, svc.post_job({"samples": items(2, seed=3), "layers": "eagle3_pre_norm"}).json())
        assert "--capture-layers" in (job["waiting_reason"] or ""), job
        assert svc.get("/healthz").json()["writer"]["state"] == "refusing"
        assert all(s["attempts"] == 0 for s in svc.get(f"/v1/jobs/{job['id']}/samples").json()["data"])
    finally:
        svc.stop()


def test_vllms_own_class_on_the_cpu_dies_at_the_probe_and_the_writer_says_the_engine_died(tmp_path, model):
    """vLLM's ExampleHiddenStatesConnector itself, on this CPU-only host: the writer's probe is the first finished
    request, which kills vLLM's engine. The job waits saying the engine died, and what kills it here, instead of
    asking about --capture-layers and the storage path; no sample spends an attempt."""
    tmp = tmp_path / "vllm"
    tmp.mkdir()
    own = VLLM(vllm_python(), tmp, model[0], LAYERS, tmp / "dumps", connector=VLLMS_OWN).start()
    svc = service(tmp_path, own, "--source", "vllm", "--capture-layers", CAPTURE)
    try:
        job = svc.post_job({"samples": items(2, seed=5), "layers": "eagle3_pre_norm"}).json()
        deadline = time.monotonic() + 300
        while "engine died" not in (job["waiting_reason"] or "") and time.monotonic() < deadline:
            time.sleep(0.5)
            job = svc.get(f"/v1/jobs/{job['id']}").json()
        reason = job["waiting_reason"] or ""
        assert "its engine died or the server exited" in reason and "pin_memory=True" in reason, reason
        assert "shared_storage_path" not in reason and "eagle_aux_hidden_state_layer_ids" not in reason, reason
        assert "pin_memory=True requires a CUDA or other accelerator backend" in own.log(), "the cause, in its log"
        assert all(s["attempts"] == 0 for s in svc.get(f"/v1/jobs/{job['id']}/samples").json()["data"])
    finally:
        svc.stop()
        own.stop()


def test_a_job_stores_every_sample_from_the_stock_files(tmp_path, server, model):
    svc = service(tmp_path, server, "--source", "vllm", "--capture-layers", CAPTURE)
    try:
        samples = items(30, seed=1)
        job = svc.wait_job(svc.post_job({"samples": samples, "layers": "eagle3_pre_norm"}).json()["id"], timeout=600)
        worst = largest_difference(svc, model[1], job, samples, LAYERS)
        relative = largest_difference(svc, model[1], job, samples, LAYERS, relative=True)
        print(f"stock files, {len(samples)} samples: max abs difference {worst:.3g}, relative {relative:.3g}")
        assert worst <= 1e-4 and relative <= 1e-5
        said = svc.get("/healthz").json()["writer"]["server"]
        assert said["source"] == "vllm" and said["identity"] == "ids" and said["layers"] == LAYERS
        assert said["layers_from"].startswith("--capture-layers") and said["boot_id"].startswith("vllm-started-")
        assert said["layers_unverified"].startswith(f"--capture-layers {CAPTURE} is the operator's word")
        assert "not verified: --capture-layers" in svc.proc.log(), "said at start too"
        assert not (server.storage / "hsx-vllm.json").exists(), "the stock files come with nothing of hsx's"
        assert not list(server.storage.glob("cmpl-*")), "each file and its lock removed once staged"
    finally:
        svc.stop()


def test_a_dump_root_the_server_does_not_write_to_leaves_nothing_in_the_servers_folder(tmp_path, server):
    """vLLM's own files come with no hsx-vllm.json to tell the folder by: the probe's answer names its file in
    the server's folder. The writer refuses before any attempt, says where the server writes, and removes
    what its probe left there (each probe's file and lock, in /dev/shm on a real host)."""
    svc = start_service(
        tmp_path,
        f"sqlite:///{tmp_path / 'hsx.db'}",
        backend_url=server.url,
        dump_root=tmp_path / "elsewhere",
        extra=["--source", "vllm", "--capture-layers", CAPTURE],
    )
    try:
        job = svc.post_job({"samples": items(2, seed=3), "layers": "eagle3_pre_norm"}).json()
        deadline = time.monotonic() + 120
        while not job["waiting_reason"] and time.monotonic() < deadline:
            time.sleep(0.2)
            job = svc.get(f"/v1/jobs/{job['id']}").json()
        reason = job["waiting_reason"] or ""
        assert f"the server writes its files to {server.storage}" in reason, job
        assert "hsx removed that file and its lock" in reason
        assert svc.get("/healthz").json()["writer"]["state"] == "refusing"
        time.sleep(3)  # the second probe, 2 s after the first
        assert not list(server.storage.glob("cmpl-*probe-*")), "nothing of hsx's probes left in the server's folder"
        assert all(s["attempts"] == 0 for s in svc.get(f"/v1/jobs/{job['id']}/samples").json()["data"])
    finally:
        svc.stop()


def test_auto_takes_the_server_that_says_it_is_vllm_when_given_its_layers(tmp_path, server, model):
    svc = service(tmp_path, server, "--capture-layers", CAPTURE)  # --source auto, the default
    try:
        samples = items(4, seed=2)
        job = svc.wait_job(svc.post_job({"samples": samples, "layers": "eagle3_pre_norm"}).json()["id"], timeout=300)
        assert largest_difference(svc, model[1], job, samples, LAYERS) <= 1e-4
        assert svc.get("/healthz").json()["writer"]["server"]["source"] == "vllm"
    finally:
        svc.stop()


def test_a_restart_mid_job_shows_as_a_new_start_time(tmp_path, server, model):
    """Last in the module: it kills the server. Every sample stored, each proven and exact, and the writer saw
    the restart in the API server's new start time."""
    svc = service(tmp_path, server, "--source", "vllm", "--capture-layers", CAPTURE)
    try:
        samples = items(60, seed=4)
        job_id = svc.post_job({"samples": samples, "layers": "eagle3_pre_norm"}).json()["id"]
        deadline = time.monotonic() + 300
        while svc.get(f"/v1/jobs/{job_id}").json()["counts"]["queued"] > len(samples) // 2:
            assert time.monotonic() < deadline, "the job made no progress"
            time.sleep(0.1)
        before = svc.get("/healthz").json()["writer"]["server"]["boot_id"]
        server.kill()
        time.sleep(2)
        server.restart()
        job = svc.wait_job(job_id, timeout=900)
        assert largest_difference(svc, model[1], job, samples, LAYERS) <= 1e-4
        after = svc.get("/healthz").json()["writer"]["server"]["boot_id"]
        assert before.startswith("vllm-started-") and after.startswith("vllm-started-") and after != before
        assert "model server restarted" in svc.proc.log()
    finally:
        svc.stop()

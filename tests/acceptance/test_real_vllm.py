"""Jobs against a real vLLM 0.32.0 (its CPU build) with hsx's connector, `hsx serve --source vllm`:
every stored tensor proven by the file's token ids and equal to a transformers recomputation, several
requests in flight, prompts sharing a prefix with vLLM's prefix cache on, the default job's layer L after
the final norm hsx applies, the server SIGKILLed and restarted mid-job, and a dump root the server does not
write to (refused before any attempt)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.real_vllm import (
    EAGLE3_LAYERS,
    VLLM,
    check_final_norm_by_hsx,
    items,
    largest_difference,
    norm_weight_sha256,
    tiny_model,
    vllm_python,
)
from tests.support.stack import Service, start_service
from tests.support.tiny_llama import VOCAB

pytestmark = pytest.mark.slow  # one real vLLM for the module: 30-95 s to start

LAYERS = EAGLE3_LAYERS


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    return tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model: tuple[Path, torch.nn.Module]) -> Iterator[VLLM]:
    tmp = tmp_path_factory.mktemp("vllm")
    s = VLLM(vllm_python(), tmp, model[0], LAYERS, tmp / "dumps").start()
    yield s
    s.stop()


def service(tmp_path: Path, server: VLLM, *extra: str, source: str = "vllm") -> Service:
    return start_service(
        tmp_path,
        f"sqlite:///{tmp_path / 'hsx.db'}",
        backend_url=server.url,
        dump_root=server.storage,
        extra=["--source", source, *extra],
    )


def check(svc: Service, m: torch.nn.Module, job: dict[str, Any], samples: list[dict[str, Any]]) -> float:
    """Every stored tensor against the recomputation of its own ids; the largest difference."""
    return largest_difference(svc, m, job, samples, LAYERS)


def test_a_job_stores_every_sample_proven_by_its_ids(tmp_path, server, model):
    svc = service(tmp_path, server, "--max-in-flight", "4")
    try:
        samples = items(30, seed=1)
        job = svc.wait_job(svc.post_job({"samples": samples, "layers": "eagle3_pre_norm"}).json()["id"], timeout=600)
        assert check(svc, model[1], job, samples) <= 1e-4
        writer = svc.get("/healthz").json()["writer"]
        assert writer["server"]["source"] == "vllm" and writer["server"]["identity"] == "ids"
        pages = svc.get(f"/v1/jobs/{job['id']}/samples?limit=100").json()["data"]
        assert all(s["attempts"] == 1 for s in pages)
        assert not list(server.storage.glob("cmpl-*")), "each file and its lock removed once staged"
    finally:
        svc.stop()


def test_prompts_sharing_a_prefix_with_the_prefix_cache_on(tmp_path, server, model):
    """vLLM keeps the hidden-state rows with its cached KV blocks: every row is in every file. With
    --source auto: hsx-vllm.json in the dump root says it is vLLM."""
    svc = service(tmp_path, server, source="auto")
    try:
        shared = [random.Random(9).randrange(VOCAB) for _ in range(300)]  # more than two cache blocks
        samples = items(8, seed=2, prefix=shared)
        job = svc.wait_job(svc.post_job({"samples": samples, "layers": "eagle3_pre_norm"}).json()["id"], timeout=600)
        assert check(svc, model[1], job, samples) <= 1e-4
    finally:
        svc.stop()


def test_a_dump_root_the_server_does_not_write_to_is_refused_before_any_attempt(tmp_path, server):
    svc = start_service(
        tmp_path,
        f"sqlite:///{tmp_path / 'hsx.db'}",
        backend_url=server.url,
        dump_root=tmp_path / "elsewhere",
        extra=["--source", "vllm"],
    )
    try:
        job = svc.post_job({"samples": items(2, seed=3), "layers": "eagle3_pre_norm"}).json()
        deadline = time.monotonic() + 60
        while not job["waiting_reason"] and time.monotonic() < deadline:
            time.sleep(0.2)
            job = svc.get(f"/v1/jobs/{job['id']}").json()
        assert "hsx-vllm.json" in (job["waiting_reason"] or ""), job
        assert svc.get("/healthz").json()["writer"]["state"] == "refusing"
        assert all(s["attempts"] == 0 for s in svc.get(f"/v1/jobs/{job['id']}/samples").json()["data"])
    finally:
        svc.stop()


def test_the_default_job_reads_layer_l_after_the_final_norm_hsx_applies(tmp_path, server, model):
    """vLLM gives L before the final norm; the default job (eagle3) reads it after: hsx applies the model's
    own norm, its weight read from the checkpoint vLLM reports. The stored L equals transformers' norm module
    applied to the same samples' pre-norm L (an eagle3_pre_norm job's) within 1e-6 of each value's magnitude
    (at least 1; float32 sums the mean of squares in another order there), and transformers' hidden_states[L]
    (SGLang's post-norm L, within 1e-5 of it in the plugin's tests) within 1e-4."""
    svc = service(tmp_path, server, "--max-in-flight", "4")
    try:
        deadline = time.monotonic() + 120
        while (writer := svc.get("/healthz").json()["writer"])["state"] != "ready":  # its probe first
            assert time.monotonic() < deadline, writer
            time.sleep(0.2)
        server_said = writer["server"]
        assert {"eagle3", "eagle3_pre_norm"} <= set(server_said["layer_sets"]), server_said
        assert server_said["final_norm"]["sha256"] == norm_weight_sha256(model[0])
        samples = items(12, seed=6)
        post = svc.post_job({"samples": samples}).json()
        assert post["layers"] == "eagle3"
        pre = svc.post_job({"samples": samples, "layers": "eagle3_pre_norm"}).json()
        post, pre = svc.wait_job(post["id"], timeout=600), svc.wait_job(pre["id"], timeout=600)
        by_norm = by_transformers = 0.0
        for sample_id, after, before in check_final_norm_by_hsx(svc, post, pre, samples, model[0]):
            ids = next(s["input_ids"] for s in samples if s["id"] == sample_id)
            with torch.no_grad():
                normed = model[1].model.norm(before)
                final = model[1](torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
            by_norm = max(by_norm, ((after - normed).abs() / normed.abs().clamp_min(1)).max().item())
            by_transformers = max(by_transformers, (after - final).abs().max().item())
        print(
            f"float32 L: hsx's vs the norm module {by_norm:.3g} (relative), vs hidden_states[L] {by_transformers:.3g}"
        )
        assert by_norm <= 1e-6 and by_transformers <= 1e-4
    finally:
        svc.stop()


def test_the_server_killed_and_restarted_mid_job(tmp_path, server, model):
    """Last in the module: it kills the server. Every sample stored, each proven and exact."""
    svc = service(tmp_path, server, "--max-in-flight", "4")
    try:
        samples = items(80, seed=4)
        job_id = svc.post_job({"samples": samples, "layers": "eagle3_pre_norm"}).json()["id"]
        deadline = time.monotonic() + 300
        while svc.get(f"/v1/jobs/{job_id}").json()["counts"]["queued"] > len(samples) // 2:
            assert time.monotonic() < deadline, "the job made no progress"
            time.sleep(0.1)
        server.kill()
        time.sleep(2)
        server.restart()
        job = svc.wait_job(job_id, timeout=900)
        assert check(svc, model[1], job, samples) <= 1e-4
    finally:
        svc.stop()

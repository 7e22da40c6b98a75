"""/healthz and /v1/workers say which layer sets each writer's server gives, and /healthz warns (its status
staying ok) while no ready writer gives the default set, on SQLite and Postgres. The writers are registered
in the database with what a writer reports of its server (hsx.extraction.server_watch.server_report), built
from the engines' own captures: vLLM's as hsx's connector describes it (hsx-vllm.json), and SGLang's dumps
with EAGLE-3's layers after the final norm. The HTTP API runs in this process, without a writer."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from hsx.api.app import create_app
from hsx.backends.dumps import DumpRoot
from hsx.backends.engine import Capture, Limits, Server
from hsx.backends.engines.sglang_dumps import DumpsEngine
from hsx.backends.engines.vllm import VLLM_INFO_FORMAT, VLLMEngine, vllm_capture
from hsx.backends.model import describe_model
from hsx.config import Settings
from hsx.db import repository as repo
from hsx.db.engine import make_engine, session_factory, upgrade
from hsx.extraction.output_root import shared_output_root
from hsx.extraction.server_watch import server_report
from hsx.identity import Identity
from hsx.layers import eagle3_capture_layers

MODEL = {"model_path": "/models/llama", "model_type": "llama", "num_hidden_layers": 8, "hidden_size": 64}
VLLM_WRITER, SGLANG_WRITER = "vm:/data/dumps1", "gpu:/dev/shm/sglang_hs"


@pytest.fixture
def sessions(database_url):
    engine = make_engine(database_url)
    upgrade(engine)
    yield session_factory(engine)
    engine.dispose()


def settings(tmp_path: Path, database_url: str, **more) -> Settings:
    return Settings(database_url=database_url, output_root=tmp_path / "out", run_writer=False, **more)


@pytest.fixture
def api(tmp_path, database_url, sessions):
    with sessions.begin() as s:
        shared_output_root(s, tmp_path / "out", mark=True)
    with TestClient(create_app(settings(tmp_path, database_url, api_tokens=""))) as client:
        yield client


def vllm_report(tmp_path: Path) -> dict:
    """What a writer beside vLLM with hsx's connector reports: EAGLE-3's layers, L before the final norm."""
    info = {"format": VLLM_INFO_FORMAT, "layers": [2, 4, 5, 8], "num_hidden_layers": 8, "hidden_size": 64}
    info |= {"dtype": "bfloat16", "model_path": "/models/llama", "boot_id": "b1"}
    server = Server("http://127.0.0.1:9", DumpRoot(tmp_path / "vllm"), tmp_path / "staging")
    engine = VLLMEngine(server, vllm_capture(info, server.root.path), model="/models/llama")
    return server_report(server.url, engine, Identity.IDS, Limits(vocab_size=512))


def sglang_report(tmp_path: Path) -> dict:
    """What a writer beside SGLang with the hsx-sglang plugin reports: EAGLE-3's layers, L after the final norm."""
    capture = Capture(
        layers=eagle3_capture_layers(8), model=describe_model(MODEL, {}), layers_from="the hsx-sglang plugin's dumps"
    )
    server = Server("http://127.0.0.1:9", DumpRoot(tmp_path / "sglang"), tmp_path / "staging")
    return server_report(server.url, DumpsEngine(server, capture, plugin=True), Identity.IDS, Limits())


def report(sessions, identity: str, state: str, server: dict | None, reason: str | None = None) -> None:
    with sessions.begin() as s:
        epoch = repo.register_writer(s, identity, lease_s=30, started_at=repo.utcnow(), staged_exists=lambda _: True)
        repo.renew_lease(s, identity, epoch, lease_s=30, state=state, reason=reason, server=server, stats=None)


def test_a_vllm_only_fleet_is_ok_but_warned_that_default_jobs_wait(tmp_path, sessions, api):
    report(sessions, VLLM_WRITER, "ready", vllm_report(tmp_path))
    health = api.get("/healthz").json()
    assert health["status"] == "ok", "probes that read the status are not failed by a working vLLM fleet"
    (writer,) = health["writers"]
    assert writer["layer_sets"] == ["eagle3_pre_norm", "last_pre_norm"] and writer["serves_default"] is False
    (warning,) = health["warnings"]
    assert warning.startswith("no ready writer gives the default layers eagle3 (")
    given = "the ready writers give eagle3_pre_norm and last_pre_norm: ask for one of them"
    assert f"{given} (hsx submit --layers eagle3_pre_norm" in warning
    (worker,) = api.get("/v1/workers").json()["data"]
    assert (worker["layer_sets"], worker["serves_default"]) == (["eagle3_pre_norm", "last_pre_norm"], False)

    job = api.post("/v1/jobs", json={"samples": [{"id": "a", "input_ids": [1, 2, 3]}]}).json()
    waiting = api.get(f"/v1/jobs/{job['id']}").json()["waiting_reason"]
    assert "the worker on vm reading /data/dumps1 (vLLM's hidden-states files) gives layers [2, 4, 5, 8]" in waiting

    report(sessions, SGLANG_WRITER, "ready", sglang_report(tmp_path))
    health = api.get("/healthz").json()
    assert health["warnings"] == []
    by_identity = {w["identity"]: w for w in health["writers"]}
    sglang = by_identity[SGLANG_WRITER]
    assert sglang["layer_sets"] == ["eagle3", "last"] and sglang["serves_default"]

    # SGLang's server goes away: its writer waits, and no ready writer gives the default set again.
    report(sessions, SGLANG_WRITER, "waiting", None, reason="model server not ready: GET /health: ConnectError")
    health = api.get("/healthz").json()
    assert len(health["warnings"]) == 1 and health["status"] == "ok"
    assert {w["identity"]: w["serves_default"] for w in health["writers"]} == {VLLM_WRITER: False, SGLANG_WRITER: None}


def test_the_warning_names_no_host_and_is_shown_without_a_token(tmp_path, database_url, sessions):
    with sessions.begin() as s:
        shared_output_root(s, tmp_path / "out", mark=True)
    report(sessions, VLLM_WRITER, "ready", vllm_report(tmp_path))
    with TestClient(create_app(settings(tmp_path, database_url, api_tokens="secret"))) as client:
        health = client.get("/healthz").json()
    assert health["writers"] == [] and len(health["warnings"]) == 1
    assert "vm" not in health["warnings"][0].split() and "/data/dumps1" not in health["warnings"][0]

"""Against a real SGLang 0.5.23 launched for plugin mode whose plugin failed to load (SGLang logs it
and serves on): hsx refuses before any sample is spent where it was told to expect dumps, and takes
the aux layers from the answers where nothing says there is a plugin."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.real_sglang import AUX, PLUGIN_FLAGS, SGLang, make_items, run_and_check, sglang_python
from tests.support.stack import start_service
from tests.support.tiny_llama import NUM_LAYERS, make_model

pytestmark = pytest.mark.slow  # one real SGLang for the module: 30-95 s to start


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("model")
    return path, make_model(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model: tuple[Path, torch.nn.Module]) -> Iterator[SGLang]:
    """The README's plugin-mode launch plus --enable-return-hidden-states, the plugin broken."""
    tmp = tmp_path_factory.mktemp("sglang")
    env = {"SGLANG_PLUGINS": "hsx_dump", "HSX_DUMP_ROOT": str(tmp / "dumps")}
    flags = [*PLUGIN_FLAGS, "--enable-return-hidden-states"]
    s = SGLang(sglang_python(), tmp, model[0], flags, env, broken_plugin=True).start()
    yield s
    s.stop()


def test_the_plugin_failed_to_load_in_the_real_server(server):
    """Keeps the test-made fault honest: SGLang's own loader met it and said so."""
    assert "Failed to load plugin" in server.log()


def test_a_plugin_file_from_an_earlier_launch_is_refused_before_any_attempt(tmp_path, server):
    """hsx-plugin.json says there is a plugin, the server's did not load: the probe at writer start finds
    no dump, and the writer refuses with the reason; no sample is spent."""
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    earlier = {"format": "hsx-plugin/1", "name_by": "rid", "layers": [*AUX, NUM_LAYERS], "rid_prefix": "hsx-"}
    (dumps / "hsx-plugin.json").write_text(json.dumps(earlier | {"boot_id": "an-earlier-launch"}))
    svc = start_service(
        tmp_path,
        f"sqlite:///{tmp_path / 'hsx.db'}",
        backend_url=server.url,
        dump_root=dumps,
        extra=["--dump-wait-s", "2"],
    )
    try:
        job = svc.post_job({"samples": make_items(2, seed=6)}).json()
        deadline = time.monotonic() + 90
        while "probe" not in (job["waiting_reason"] or "") and time.monotonic() < deadline:
            time.sleep(0.2)
            job = svc.get(f"/v1/jobs/{job['id']}").json()
        assert "Failed to load plugin" in (job["waiting_reason"] or ""), job
        assert job["counts"]["queued"] == 2
        assert all(s["attempts"] == 0 for s in svc.get(f"/v1/jobs/{job['id']}/samples").json()["data"])
        assert svc.get("/healthz").json()["writer"]["state"] == "refusing"
    finally:
        svc.stop()


def test_without_a_plugin_the_aux_layers_come_from_the_answers(tmp_path, server, model):
    """--source auto, no plugin file: the three aux layers, streamed out of each answer, exact."""
    svc = start_service(tmp_path, f"sqlite:///{tmp_path / 'hsx.db'}", backend_url=server.url, dump_root=tmp_path / "d")
    try:
        job, worst = run_and_check(svc, model[1], AUX, n=20, seed=7)
        assert worst <= 1e-5, worst
        health = svc.get("/healthz").json()["writer"]["server"]
        assert health["identity"] == "response"
        assert all(s["attempts"] == 1 for s in svc.get(f"/v1/jobs/{job['id']}/samples?limit=100").json()["data"])
    finally:
        svc.stop()

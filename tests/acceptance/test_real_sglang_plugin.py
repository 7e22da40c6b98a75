"""Plugin mode against a real SGLang 0.5.23, launched as deploy/sglang/README.md says and with
SGLang's defaults (its warm-up request, the radix cache on), capturing the union of two layer sets (eagle3
and dflash): exact tensors, jobs of either set and of both, the imitation's answers beside the real ones, and
the server SIGKILLed and restarted mid-job (the module's last test)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from hsx.backends.final_norm import load_final_norm
from hsx.dtypes import DTYPES
from hsx.manifest import load_manifest, read_sample
from hsx.storage.safetensors_raw import read_index
from hsx.training.dataset import HiddenStateDataset
from tests.support.real_sglang import (
    AUX,
    PLUGIN_FLAGS,
    SGLang,
    check_stored,
    make_items,
    run_and_check,
    sglang_python,
    truth,
)
from tests.support.real_vllm import truth as pre_norm_truth
from tests.support.stack import start_service, start_stock_sglang
from tests.support.tiny_llama import NUM_LAYERS, VOCAB, make_model

pytestmark = pytest.mark.slow  # one real SGLang for the module: 30-95 s to start


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("model")
    return path, make_model(path)


# The union of eagle3's and dflash's aux layers on the 8-layer model, [2, 3, 4, 5, 6] in hsx's numbering, in
# SGLang's (one less), as deploy/sglang/README.md configures a capture for several layer sets: jobs of
# either set, or both, run on this one server.
UNION_FLAGS = [*PLUGIN_FLAGS, "--return-aux-hidden-state-layer-ids", "1", "2", "3", "4", "5"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, model: tuple[Path, torch.nn.Module]) -> Iterator[SGLang]:
    tmp = tmp_path_factory.mktemp("sglang")
    env = {"SGLANG_PLUGINS": "hsx_dump", "HSX_DUMP_ROOT": str(tmp / "dumps")}
    s = SGLang(sglang_python(), tmp, model[0], UNION_FLAGS, env).start()
    yield s
    s.stop()


def dump_root(server: SGLang) -> Path:
    return Path(server.env["HSX_DUMP_ROOT"])


def test_plugin_mode_stores_every_sample_exactly(tmp_path, server, model):
    # --log-level debug: the log then holds a line for each request hsx sends to the model server.
    svc = start_service(
        tmp_path,
        f"sqlite:///{tmp_path / 'hsx.db'}",
        backend_url=server.url,
        dump_root=dump_root(server),
        extra=["--log-level", "debug"],
    )
    try:
        job, worst = run_and_check(svc, model[1], [*AUX, NUM_LAYERS], n=30, seed=1)
        # One request in flight: the same arithmetic as transformers' own forward.
        assert worst <= 1e-5, worst
        assert svc.get("/healthz").json()["writer"]["server"]["identity"] == "ids"
        samples = svc.get(f"/v1/jobs/{job['id']}/samples?limit=100").json()["data"]
        assert [s["attempts"] for s in samples] == [1] * 30, "no attempt was spent on a refusal"
        asked = svc.proc.log()
        assert "/model_info " in asked and "/server_info " in asked, "SGLang 0.5.23's current names"
        assert "/get_model_info" not in asked and "/get_server_info" not in asked, "not the deprecated ones"
    finally:
        svc.stop()


def test_a_job_of_two_layer_sets_stores_each_layer_once_and_reads_each_set_back(tmp_path, server, model):
    """eagle3 and dflash in one job: their union captured once, each layer stored once, each set read back by
    name equal to transformers' hidden states. SGLang's post-norm L is also hsx's own final norm (what it
    applies to vLLM's pre-norm L) applied to transformers' pre-norm L."""
    svc = start_service(
        tmp_path, f"sqlite:///{tmp_path / 'hsx.db'}", backend_url=server.url, dump_root=dump_root(server)
    )
    try:
        items = make_items(12, seed=7)
        job = svc.post_job({"samples": items, "layers": ["dflash", "eagle3"]}).json()
        assert job["layers"] == ["eagle3", "dflash"]
        job = svc.wait_job(job["id"], timeout=600)
        assert job["state"] == "succeeded", job
        folder = svc.output_root / job["id"]
        manifest = load_manifest(folder)
        assert manifest.layers == [2, 3, 4, 5, 6, NUM_LAYERS] and manifest.final_norm is None
        assert manifest.layer_sets == {"eagle3": [2, 4, 5, 8], "dflash": [2, 3, 4, 5, 6, 8], "last": [8]}
        for shard in manifest.shards:
            names = [k for k in read_index(folder / shard.name) if k.startswith("layer_")]
            assert sorted(names) == sorted(f"layer_{i}" for i in manifest.layers), "each layer once"
        by_id = {s["id"]: s["input_ids"] for s in items}
        worst = 0.0
        for name, aux in (("eagle3", [2, 4, 5]), ("dflash", [2, 3, 4, 5, 6])):
            ds = HiddenStateDataset(folder, layer_set=name)
            assert ds.aux_layers == aux and ds.last_layer == NUM_LAYERS
            for k, sample_id in enumerate(ds.sample_ids):
                want = truth(model[1], by_id[sample_id], [*aux, NUM_LAYERS])
                item, aux_want = ds[k], torch.cat([want[i] for i in aux], dim=-1)
                worst = max(worst, (item["aux_hidden_state"] - aux_want).abs().max().item())
                worst = max(worst, (item["hidden_state"] - want[NUM_LAYERS]).abs().max().item())
        assert worst <= 1e-5, worst
        norm = load_final_norm(manifest.model or {})
        by_norm = 0.0
        for sample_id in ds.sample_ids:
            before = pre_norm_truth(model[1], by_id[sample_id], [NUM_LAYERS])[NUM_LAYERS]
            normed = norm.apply(before.numpy().view("uint8"), DTYPES["float32"]).view("<f4")
            stored = read_sample(folder, manifest, sample_id)[f"layer_{NUM_LAYERS}"]
            by_norm = max(by_norm, (stored - torch.from_numpy(normed.copy())).abs().max().item())
        print(f"SGLang's post-norm L vs hsx's norm of transformers' pre-norm L: {by_norm:.3g}")
        assert by_norm <= 1e-4
    finally:
        svc.stop()


SERVER_FIELDS = (
    "model_path",
    "dtype",
    "chunked_prefill_size",
    "disable_radix_cache",
    "enable_return_hidden_states",
    "return_hidden_states_mode",
    "enable_return_aux_hidden_states",
    "return_aux_hidden_state_layer_ids",
    "max_req_input_len",
)
IDS = [5, 17, 33, 2, 91, 14, 7]
REQUESTS = {
    "plugin request": {"input_ids": IDS, "rid": "hsx-p1", "extra_key": "k1", "return_logprob": True},
    "rows in the answer": {"input_ids": IDS, "rid": "hsx-p2", "extra_key": "k2", "return_hidden_states": True},
    '"last" as a string': {"input_ids": IDS, "rid": "hsx-p3", "return_hidden_states": "last"},
    "a number for a bool": {"input_ids": IDS, "rid": "hsx-p4", "return_logprob": 1},
    "a batch under one rid": {"input_ids": [IDS, IDS[:3]], "rid": "hsx-b", "extra_key": ["b0", "b1"]},
    "no new token": {"input_ids": IDS, "rid": "hsx-p5", "sampling_params": {"max_new_tokens": 0}},
}


def shape(value: Any) -> list[int]:
    dims = []
    while isinstance(value, list):
        dims.append(len(value))
        value = value[0] if value else None
    return dims


def answer_view(resp: httpx.Response) -> object:
    """What hsx relies on in an answer: its status, and per sequence the id, token counts and the
    shape of the hidden states it carries."""
    if resp.status_code != 200:
        return resp.status_code
    body = resp.json()
    return [
        (
            a["meta_info"]["id"],
            a["meta_info"]["prompt_tokens"],
            a["meta_info"]["cached_tokens"],
            shape(a["meta_info"].get("hidden_states")),
        )
        for a in (body if isinstance(body, list) else [body])
    ]


def test_the_imitation_answers_as_the_real_server_does(tmp_path, server, model):
    """The same requests to the real SGLang and to `hsx reference-server --stock-sglang` launched alike:
    the same status codes, and in each answer the same fields hsx reads; the same server settings."""
    imitation = start_stock_sglang(
        tmp_path, model[0], dump_root=tmp_path / "i", flags=[*UNION_FLAGS, "--dtype", "float32"]
    )
    try:
        with httpx.Client(timeout=60) as c:
            for what, request in REQUESTS.items():
                body = {"sampling_params": {"max_new_tokens": 1}} | request
                got = [answer_view(c.post(url + "/generate", json=body)) for url in (server.url, imitation.url)]
                assert got[0] == got[1], (what, got)
            infos = [c.get(url + "/server_info").json() for url in (server.url, imitation.url)]
            for field in SERVER_FIELDS:
                assert infos[0].get(field) == infos[1].get(field), (field, infos[0].get(field), infos[1].get(field))
            models = [c.get(url + "/model_info").json() for url in (server.url, imitation.url)]
            assert models[0]["model_path"] == models[1]["model_path"] == str(model[0])
        for rid in ("hsx-p1", "hsx-b_0", "hsx-b_1"):
            real_done = (dump_root(server) / f"req_{rid}" / "done").exists()
            assert real_done == (tmp_path / "i" / f"req_{rid}" / "done").exists(), rid
    finally:
        imitation.proc.stop()


class OtherClient(threading.Thread):
    """Another user of the same server: generates, and asks for health checks that run forwards."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.stop, self.sent = url, threading.Event(), 0

    def run(self) -> None:
        rng = random.Random(5)
        with httpx.Client(timeout=60) as c:
            while not self.stop.is_set() and self.sent < 2000:
                ids = [rng.randrange(VOCAB) for _ in range(rng.randint(5, 80))]
                try:
                    c.post(self.url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})
                    c.get(self.url + "/health_generate")
                    self.sent += 1
                except httpx.HTTPError:
                    time.sleep(0.5)  # the server is being restarted


def test_beside_another_client_with_four_in_flight_through_a_kill_and_restart(tmp_path, server, model):
    """Four requests in flight, another client and health checks all along; the server SIGKILLed
    mid-job and started again: every sample stored, exact. Last in the module: it kills the server."""
    svc = start_service(
        tmp_path,
        f"sqlite:///{tmp_path / 'hsx.db'}",
        backend_url=server.url,
        dump_root=dump_root(server),
        extra=["--max-in-flight", "4"],
    )
    other = OtherClient(server.url)
    other.start()
    try:
        items = make_items(120, seed=4)
        items += [{"id": f"longer-{i}", "input_ids": s["input_ids"] + [7, 8, 9]} for i, s in enumerate(items[:10])]
        job_id = svc.post_job({"samples": items}).json()["id"]
        deadline = time.monotonic() + 300
        while svc.get(f"/v1/jobs/{job_id}").json()["counts"]["queued"] > len(items) // 2:
            assert time.monotonic() < deadline, "the job made no progress"
            time.sleep(0.1)
        server.kill()
        time.sleep(2)
        server.restart()
        job = svc.wait_job(job_id, timeout=600)
        # Prefill batches of several requests round differently from one prompt alone: within 1e-5.
        assert check_stored(svc, model[1], job, items, [*AUX, NUM_LAYERS], "float32") <= 1e-5
        assert other.sent > 0
        rows = svc.get(f"/v1/jobs/{job_id}/samples?limit=200").json()["data"]
        spent = {r["id"]: svc.get(f"/v1/jobs/{job_id}/samples/{r['id']}").json() for r in rows if r["attempts"] != 1}
        # The restart spends no attempt, and no prompt is served from the cache: what did, with its log.
        assert spent == {}
    finally:
        other.stop.set()
        svc.stop()

"""The reference server as stock SGLang 0.5.23 (--stock-sglang), its dumps written by the hsx-sglang
plugin's own hook code: what SGLang does that hsx depends on, checked over real HTTP, and the
plugin's dumps checked against transformers."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from tests.support.stack import HIDDEN, NUM_LAYERS, start_stock_sglang

AUX = [2, NUM_LAYERS // 2, NUM_LAYERS - 3]
AUX_FLAGS = ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3"]


@pytest.fixture(scope="module")
def plugged(tmp_path_factory, checkpoint):
    """Stock SGLang with aux capture, the prefix cache on (SGLang's default) and the plugin."""
    tmp = tmp_path_factory.mktemp("stock")
    server = start_stock_sglang(tmp, checkpoint, dump_root=tmp / "dumps", flags=AUX_FLAGS)
    yield server
    server.stop()


def generate(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/generate", json=body, timeout=60)


def wait_dump(root: Path, rid: str, timeout: float = 10.0) -> Path:
    d = root / f"req_{rid}"
    deadline = time.monotonic() + timeout
    while not (d / "done").exists():
        assert time.monotonic() < deadline, f"no dump for {rid}"
        time.sleep(0.02)
    return d


def aux_rows(truth: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.cat([truth[i] for i in AUX], dim=1)


def test_info_endpoints_use_sglang_field_names(plugged):
    info = httpx.get(plugged.url + "/get_server_info").json()
    assert info == httpx.get(plugged.url + "/server_info").json() | {"startup_time": info["startup_time"]}
    assert info["version"] == "0.5.23" and "hs_dump" not in info
    assert info["enable_return_aux_hidden_states"] is True
    assert info["speculative_algorithm"] is None, "SGLang resets it: aux capture runs no draft"
    assert info["return_hidden_states_mode"] == "full" and info["return_aux_hidden_state_layer_ids"] is None
    assert info["disable_radix_cache"] is False and info["chunked_prefill_size"] == -1
    model = httpx.get(plugged.url + "/get_model_info").json()
    assert model["architectures"] == ["LlamaForCausalLM"] and model["is_generation"] is True
    assert "num_hidden_layers" not in model and "hidden_size" not in model


def test_warm_up_and_health_checks_are_never_dumped(plugged):
    assert httpx.get(plugged.url + "/health", timeout=30).status_code == 200
    assert httpx.get(plugged.url + "/health_generate", timeout=30).status_code == 200
    log = plugged.proc.log()
    assert "rids=['HEALTH_CHECK_" in log and log.count("batch rids=") >= 3, "warm-up and health checks ran forwards"
    assert not list(plugged.dump_root.glob("req_*HEALTH*")) and not list(plugged.dump_root.glob("req_[0-9a-f]*"))
    info = json.loads((plugged.dump_root / "hsx-plugin.json").read_text())
    assert info["layers"] == [*AUX, NUM_LAYERS] and info["name_by"] == "rid" and info["hidden_size"] == HIDDEN


def test_the_plugin_dumps_what_transformers_computes(plugged, recompute):
    ids = [5, 17, 33, 2, 91, 14, 7]
    body = {"input_ids": ids, "rid": "hsx-one", "extra_key": "k1", "return_logprob": True}
    answer = generate(plugged.url, body | {"sampling_params": {"max_new_tokens": 1}}).json()
    meta = answer["meta_info"]
    assert meta["id"] == "hsx-one" and meta["prompt_tokens"] == len(ids) and meta["cached_tokens"] == 0
    assert "hidden_states" not in meta, "asking for logprobs keeps the rows out of the answer"
    truth = recompute(ids)

    d = wait_dump(plugged.dump_root, "hsx-one")
    tensors = load_file(str(d / "hidden_states.safetensors"))
    assert sorted(tensors) == [f"layer_{i}" for i in sorted([*AUX, NUM_LAYERS])]
    for layer in [*AUX, NUM_LAYERS]:
        assert torch.equal(tensors[f"layer_{layer}"], truth[layer]), layer
    dump_meta = json.loads((d / "meta.json").read_text())
    plugin = json.loads((plugged.dump_root / "hsx-plugin.json").read_text())
    assert dump_meta["rid"] == "hsx-one" and dump_meta["boot_id"] == plugin["boot_id"]
    assert dump_meta["num_tokens"] == len(ids) and dump_meta["cached_tokens"] == 0


def test_requests_the_plugin_must_not_dump(plugged):
    ids = [9, 8, 7, 6]
    # Another client's rid, even asking for hidden states.
    assert generate(plugged.url, {"input_ids": ids, "rid": "other-1", "return_hidden_states": True}).status_code == 200
    # hsx's prefix without return_logprob: SGLang gives the batch no per-request row counts.
    plain = {"input_ids": ids, "rid": "hsx-plain", "extra_key": "k2", "sampling_params": {"max_new_tokens": 1}}
    assert generate(plugged.url, plain).status_code == 200
    time.sleep(0.5)
    assert not (plugged.dump_root / "req_other-1").exists() and not (plugged.dump_root / "req_hsx-plain").exists()
    assert "no dump for rid hsx-plain" in plugged.proc.log()


def test_a_batch_with_one_rid_gets_suffixes_and_one_dump_each(plugged, recompute):
    seqs = [[3, 4, 5], [60, 61, 62, 63, 64]]
    answers = generate(
        plugged.url,
        {"input_ids": seqs, "rid": "hsx-batch", "extra_key": ["b0", "b1"], "return_logprob": True},
    ).json()
    assert [a["meta_info"]["id"] for a in answers] == ["hsx-batch_0", "hsx-batch_1"]
    for i, ids in enumerate(seqs):
        tensors = load_file(str(wait_dump(plugged.dump_root, f"hsx-batch_{i}") / "hidden_states.safetensors"))
        truth = recompute(ids)
        assert all(torch.equal(tensors[f"layer_{k}"], truth[k]) for k in [*AUX, NUM_LAYERS])


def test_return_hidden_states_json_shape(plugged, recompute):
    ids = [11, 12, 13, 14, 15]
    full = generate(
        plugged.url,
        {
            "input_ids": ids,
            "extra_key": "shape",
            "return_hidden_states": True,
            "sampling_params": {"max_new_tokens": 3},
        },
    ).json()
    rows = full["meta_info"]["hidden_states"]
    assert len(rows) == 3, "the prefill rows, then one row per decode step"
    assert rows[0] == aux_rows(recompute(ids)).float().tolist()
    assert [len(r) for r in rows[1:]] == [3 * HIDDEN, 3 * HIDDEN]
    none = generate(
        plugged.url,
        {"input_ids": ids, "extra_key": "zero", "return_hidden_states": True, "sampling_params": {"max_new_tokens": 0}},
    ).json()
    assert none["meta_info"]["hidden_states"] == [], "max_new_tokens 0 returns no hidden states"


def test_prefix_cache_is_on_and_extra_key_namespaces_it(plugged):
    ids = [40, 41, 42, 43, 44, 45]
    first = generate(plugged.url, {"input_ids": ids}).json()["meta_info"]["cached_tokens"]
    again = generate(plugged.url, {"input_ids": ids}).json()["meta_info"]["cached_tokens"]
    keyed = generate(plugged.url, {"input_ids": ids, "extra_key": "fresh"}).json()["meta_info"]["cached_tokens"]
    assert (first, again, keyed) == (0, len(ids) - 1, 0)


def test_a_rid_in_flight_is_refused(plugged):
    slow = {"input_ids": [1, 2, 3], "rid": "hsx-busy", "sampling_params": {"max_new_tokens": 400}}
    worker = threading.Thread(target=generate, args=(plugged.url, slow))
    worker.start()
    try:
        time.sleep(0.3)
        second = generate(plugged.url, {"input_ids": [4, 5], "rid": "hsx-busy"})
    finally:
        worker.join()
    assert second.status_code == 400
    assert second.json()["error"]["message"] == "Duplicate request ID detected: hsx-busy"
    assert generate(plugged.url, {"input_ids": [4, 5], "rid": "hsx-busy"}).status_code == 200, "free once done"


def test_hidden_states_beyond_the_server_mode_are_refused(tmp_path, checkpoint):
    server = start_stock_sglang(
        tmp_path, checkpoint, flags=["--return-hidden-states-mode", "last", "--skip-server-warmup"]
    )
    try:
        refused = generate(server.url, {"input_ids": [1, 2], "return_hidden_states": True})
        assert refused.status_code == 400 and "exceeds the server maximum `last`" in refused.json()["error"]["message"]
        # SGLang's API contract takes only a bool (or a batch's list of bools), whatever the server's mode.
        last = generate(server.url, {"input_ids": [1, 2], "return_hidden_states": "last"})
        assert last.status_code == 400
        assert last.json()["error"]["message"] == (
            'invalid type: string "last", expected a value or an array of values for BoolOrList'
        )
        assert "hsx-sglang plugin is not installed" not in server.proc.log()
        assert "HSX_DUMP_ROOT is not set" in server.proc.log()
    finally:
        server.stop()

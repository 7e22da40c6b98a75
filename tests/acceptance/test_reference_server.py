"""The reference server as a real subprocess: SGLang-style API, dump protocol v1, bit-exact tensors."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from hsx.layers import eagle3_capture_layers
from hsx.reference.dumper import Dumper, input_ids_sha256
from hsx.reference.model import ModelRunner
from hsx.reference.server import WARMUP_INPUT_IDS, BadRequest, Engine
from tests.support.procs import Process, free_port, hsx_command

VOCAB = 256
HIDDEN = 32
LAYERS = 4
MAX_POS = 128
DUMP_FILES = {"meta.json", "hidden_states.safetensors", "input_ids.safetensors", "done"}


@dataclass
class Server:
    url: str
    dump_root: Path
    proc: Process
    client: httpx.Client

    def get(self, path: str) -> httpx.Response:
        return self.client.get(self.url + path)

    def generate(self, body: dict) -> httpx.Response:
        return self.client.post(self.url + "/generate", json=body)

    def dirs(self) -> set[str]:
        return {p.name for p in self.dump_root.iterdir() if p.name.startswith("req_")}


@dataclass
class Servers:
    counter: Server  # default layers, warm-up on, dirs named by counter
    rid: Server  # --name-by rid --layers 0,3,4 --skip-server-warmup --enable-return-hidden-states


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ckpt")
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POS,
    )
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        model = LlamaForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference(checkpoint):
    """All HF hidden states of a prompt, computed in this process from the same checkpoint."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, local_files_only=True).eval()

    def hidden_states(ids: list[int]) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        return tuple(h[0] for h in out.hidden_states)

    return hidden_states


@pytest.fixture(scope="module")
def servers(checkpoint, tmp_path_factory) -> Servers:
    base = tmp_path_factory.mktemp("ref")
    specs = {
        "counter": [],
        "rid": ["--name-by", "rid", "--layers", "0,3,4", "--skip-server-warmup", "--enable-return-hidden-states"],
    }
    started = {}
    # Start both before waiting on either: model start-up dominates the module's run time.
    for name, extra in specs.items():
        port = free_port()
        dump_root = base / f"dumps_{name}"  # absent on purpose: the server must create it
        args = hsx_command() + [
            "reference-server",
            "--model",
            str(checkpoint),
            "--dump-root",
            str(dump_root),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *extra,
        ]
        started[name] = (f"http://127.0.0.1:{port}", dump_root, Process(args, base / f"{name}.log"))
    result = {}
    try:
        for name, (url, dump_root, proc) in started.items():
            proc.wait_http(url + "/health", timeout=120)
            result[name] = Server(url, dump_root, proc, httpx.Client(timeout=60, trust_env=False))
        yield Servers(**result)
    finally:
        for server in result.values():
            server.client.close()
        for _, _, proc in started.values():
            proc.stop()
    # SIGTERM is the normal way to stop it: a graceful shutdown that exits 0.
    assert [proc.proc.returncode for _, _, proc in started.values()] == [0, 0]


def read_dump(directory: Path) -> tuple[dict, dict[str, torch.Tensor], torch.Tensor]:
    assert {p.name for p in directory.iterdir()} == DUMP_FILES
    meta = json.loads((directory / "meta.json").read_text())
    tensors = load_file(directory / "hidden_states.safetensors")
    ids = load_file(directory / "input_ids.safetensors")["input_ids"]
    return meta, tensors, ids


def one_new_dump(server: Server, before: set[str]) -> Path:
    new = server.dirs() - before
    assert len(new) == 1, new
    return server.dump_root / new.pop()


def assert_matches_reference(meta, tensors, ids, prompt, reference, layers):
    assert meta["num_tokens"] == len(prompt)
    assert meta["layers"] == layers
    assert meta["hidden_size"] == HIDDEN
    assert meta["dtype"] == "bfloat16"
    assert meta["cached_tokens"] == 0
    assert meta["input_ids_sha256"] == input_ids_sha256(prompt)
    assert ids.dtype == torch.int64 and ids.tolist() == prompt
    expected = reference(prompt)
    assert sorted(tensors) == [f"layer_{i}" for i in layers]
    for i in layers:
        got = tensors[f"layer_{i}"]
        assert got.dtype == torch.bfloat16 and got.shape == (len(prompt), HIDDEN)
        assert torch.equal(got, expected[i]), f"layer {i} differs from transformers"


def test_warmup_dump_is_req_0(servers):
    info = servers.counter.get("/get_server_info").json()
    meta, _, ids = read_dump(servers.counter.dump_root / "req_0")
    assert meta["counter"] == 0
    assert ids.tolist() == [t % VOCAB for t in WARMUP_INPUT_IDS]
    assert meta["boot_id"] == info["hs_dump"]["boot_id"]
    # wait_http's single successful /health probe is the second forward.
    health, _, health_ids = read_dump(servers.counter.dump_root / "req_1")
    assert health["rid"].startswith("HEALTH_CHECK_") and health_ids.tolist() == [0]


def test_prefill_only_generate_matches_transformers(servers, reference):
    server = servers.counter
    prompt = torch.randint(0, VOCAB, (37,), generator=torch.Generator().manual_seed(7)).tolist()
    before = server.dirs()
    reply = server.generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 0}, "rid": "p0"})
    assert reply.status_code == 200, reply.text
    assert reply.json() == {
        "text": "",
        "output_ids": [],
        "meta_info": {
            "id": "p0",
            "prompt_tokens": 37,
            "completion_tokens": 0,
            "cached_tokens": 0,
            "finish_reason": {"type": "length", "length": 0},
        },
    }
    directory = one_new_dump(server, before)
    meta, tensors, ids = read_dump(directory)
    assert directory.name == f"req_{meta['counter']}" and meta["rid"] == "p0"
    assert_matches_reference(meta, tensors, ids, prompt, reference, eagle3_capture_layers(LAYERS))


def test_decode_dumps_only_the_prompt(servers, reference):
    server = servers.counter
    prompt = [5, 6, 7, 8, 9]
    before = server.dirs()
    reply = server.generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 6}}).json()
    assert len(reply["output_ids"]) == 6 and reply["meta_info"]["completion_tokens"] == 6
    assert all(0 <= t < VOCAB for t in reply["output_ids"])
    assert len(reply["meta_info"]["id"]) == 32  # default rid: uuid4 hex
    assert "hidden_states" not in reply["meta_info"]  # not honoured without --enable-return-hidden-states
    meta, tensors, ids = read_dump(one_new_dump(server, before))
    assert_matches_reference(meta, tensors, ids, prompt, reference, eagle3_capture_layers(LAYERS))
    again = server.generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 6}}).json()
    assert again["output_ids"] == reply["output_ids"]


def test_counter_counts_health_checks(servers):
    server = servers.counter
    counters = []
    for step in ("/health", "/health_generate", "generate", "/health"):
        before = server.dirs()
        if step == "generate":
            assert server.generate({"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 1}}).status_code == 200
        else:
            assert server.get(step).status_code == 200
        meta, _, ids = read_dump(one_new_dump(server, before))
        counters.append(meta["counter"])
        if step != "generate":
            assert meta["rid"].startswith("HEALTH_CHECK_") and ids.tolist() == [0]
    assert counters == list(range(counters[0], counters[0] + 4))


def test_batch_reply_in_order(servers):
    server = servers.counter
    batch = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    before = server.dirs()
    reply = server.generate({"input_ids": batch, "rid": ["b0", "b1", "b2"], "sampling_params": {"max_new_tokens": 2}})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert [r["meta_info"]["id"] for r in body] == ["b0", "b1", "b2"]
    assert [r["meta_info"]["prompt_tokens"] for r in body] == [3, 2, 4]
    assert all(len(r["output_ids"]) == 2 for r in body)
    metas = sorted((read_dump(server.dump_root / d)[0] for d in server.dirs() - before), key=lambda m: m["counter"])
    assert [m["rid"] for m in metas] == ["b0", "b1", "b2"]
    assert [m["num_tokens"] for m in metas] == [3, 2, 4]


BAD_BODIES = {
    "no input_ids": {},
    "empty": {"input_ids": []},
    "empty sequence in batch": {"input_ids": [[1], []]},
    "float id": {"input_ids": [1.5]},
    "string id": {"input_ids": ["a"]},
    "bool id": {"input_ids": [True]},
    "out of vocab": {"input_ids": [VOCAB]},
    "negative": {"input_ids": [-1]},
    "too long": {"input_ids": [1] * (MAX_POS + 1)},
    "rid count mismatch": {"input_ids": [[1], [2]], "rid": ["a"]},
    "rid string for batch": {"input_ids": [[1], [2]], "rid": "a"},
    "duplicate rid in batch": {"input_ids": [[1], [2]], "rid": ["a", "a"]},
    "text": {"text": "The capital of France is"},
    "negative max_new_tokens": {"input_ids": [1], "sampling_params": {"max_new_tokens": -1}},
    "not an object": [1, 2, 3],
}


@pytest.mark.parametrize("name", BAD_BODIES)
def test_bad_requests_are_400_and_write_nothing(servers, name):
    server = servers.counter
    before = server.dirs()
    reply = server.generate(BAD_BODIES[name])
    assert reply.status_code == 400, reply.text
    assert isinstance(reply.json()["error"]["message"], str)
    assert server.dirs() == before


def test_invalid_json_is_400(servers):
    reply = servers.counter.client.post(
        servers.counter.url + "/generate", content=b"{nope", headers={"content-type": "application/json"}
    )
    assert reply.status_code == 400 and "error" in reply.json()


def test_server_and_model_info(servers, checkpoint):
    model_info = servers.counter.get("/get_model_info").json()
    assert model_info == {
        "model_path": str(checkpoint),
        "is_generation": True,
        "vocab_size": VOCAB,
        "num_hidden_layers": LAYERS,
        "hidden_size": HIDDEN,
        "dtype": "bfloat16",
        "max_position_embeddings": MAX_POS,
    }
    for server, name_by, layers, flags in (
        (servers.counter, "counter", [1, 2, 4], False),
        (servers.rid, "rid", [0, 3, 4], True),
    ):
        info = server.get("/get_server_info").json()
        boot_id = info["hs_dump"].pop("boot_id")
        assert len(boot_id) == 32
        assert info == {
            "model_path": str(checkpoint),
            "disable_radix_cache": True,
            "chunked_prefill_size": -1,
            "max_req_input_len": MAX_POS,
            "enable_return_hidden_states": flags,
            "skip_server_warmup": flags,
            "hs_dump": {
                "protocol": 1,
                "dump_root": str(server.dump_root),
                "name_by": name_by,
                "layers": layers,
                "dtype": "bfloat16",
                "identity": "ids",
            },
        }
    counter_boot = servers.counter.get("/get_server_info").json()["hs_dump"]["boot_id"]
    assert counter_boot != servers.rid.get("/get_server_info").json()["hs_dump"]["boot_id"]
    assert servers.counter.client.post(servers.counter.url + "/flush_cache").status_code == 200


def test_done_only_after_the_other_files(servers):
    server = servers.counter
    seen_done: list[Path] = []
    violations: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            for directory in list(server.dump_root.iterdir()):
                try:
                    names = {p.name for p in directory.iterdir()}
                except FileNotFoundError:
                    continue
                if "done" in names:
                    seen_done.append(directory)
                    if names != DUMP_FILES:
                        violations.append(f"{directory.name}: {sorted(names)}")

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for n in range(10):
            assert (
                server.generate(
                    {"input_ids": list(range(1, 60 + n)), "sampling_params": {"max_new_tokens": 0}}
                ).status_code
                == 200
            )
    finally:
        stop.set()
        watcher.join()
    assert seen_done and not violations
    for name in server.dirs():
        directory = server.dump_root / name
        read_dump(directory)
        done_at = (directory / "done").stat().st_mtime_ns
        assert all((directory / f).stat().st_mtime_ns <= done_at for f in DUMP_FILES)


def test_rid_mode_names_dirs_by_rid(servers, reference):
    server = servers.rid
    assert not any(d for d in server.dirs() if not d.startswith("req_HEALTH_CHECK_"))  # warm-up skipped
    prompt = [9, 8, 7, 6, 5, 4]
    reply = server.generate(
        {
            "input_ids": [prompt, [1, 2]],
            "rid": ["sample-1.a", "sample_2"],
            "sampling_params": {"max_new_tokens": 0},
            "return_hidden_states": True,
        }
    )
    assert reply.status_code == 200, reply.text
    first, second = reply.json()
    meta, tensors, ids = read_dump(server.dump_root / "req_sample-1.a")
    assert meta["rid"] == "sample-1.a"
    assert_matches_reference(meta, tensors, ids, prompt, reference, [0, 3, 4])
    assert read_dump(server.dump_root / "req_sample_2")[0]["num_tokens"] == 2
    expected_last = reference(prompt)[LAYERS].float()
    assert torch.equal(torch.tensor(first["meta_info"]["hidden_states"]), expected_last)
    assert len(second["meta_info"]["hidden_states"]) == 2


@pytest.mark.parametrize("rid", [".hidden", "..", "a/b", "", "sp ace", "x" * 201, "ü"])
def test_rid_mode_rejects_unsafe_rids(servers, rid):
    before = servers.rid.dirs()
    reply = servers.rid.generate({"input_ids": [1], "rid": rid, "sampling_params": {"max_new_tokens": 0}})
    assert reply.status_code == 400, reply.text
    assert servers.rid.dirs() == before


# In-process units: the pieces the subprocess tests cannot isolate.


def test_dumper_creates_done_last(tmp_path):
    calls: list[tuple[str, set[str]]] = []

    class Recording(Dumper):
        def mark_done(self, directory: Path) -> None:
            calls.append(("mark_done", {p.name for p in directory.iterdir()}))
            super().mark_done(directory)

    dumper = Recording(tmp_path, boot_id="b", dtype_name="float32", hidden_size=2)
    hidden = {2: torch.ones(3, 2), 0: torch.zeros(3, 2)}
    stale = tmp_path / "req_k"
    stale.mkdir()
    (stale / "done").touch()
    (stale / "layer_9.pt").touch()
    directory = dumper.write("k", rid="r", counter=5, input_ids=[1, 2, 3], hidden_states=hidden)
    assert calls == [("mark_done", DUMP_FILES - {"done"})]
    meta, tensors, ids = read_dump(directory)  # the stale layer_9.pt is gone
    assert meta["layers"] == [0, 2] and meta["counter"] == 5 and meta["boot_id"] == "b"
    assert torch.equal(tensors["layer_2"], torch.ones(3, 2)) and ids.tolist() == [1, 2, 3]


def test_input_ids_sha256_is_little_endian_int64():
    import hashlib

    expected = hashlib.sha256((1).to_bytes(8, "little") + (300).to_bytes(8, "little")).hexdigest()
    assert input_ids_sha256([1, 300]) == expected


def test_rid_in_flight_is_rejected():
    engine = Engine(runner=None, dumper=None, name_by="rid")
    with engine.claim_rids(["a", "b"]), pytest.raises(BadRequest), engine.claim_rids(["c", "b"]):
        pass
    with engine.claim_rids(["b", "c"]):  # released on exit
        pass


def test_layers_are_validated_and_defaulted(checkpoint):
    model = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True)
    assert ModelRunner(model, "m", [4, 0, 4]).layers == [0, 4]
    with pytest.raises(ValueError):
        ModelRunner(model, "m", [5])
    assert eagle3_capture_layers(8) == [2, 4, 5, 8]
    assert eagle3_capture_layers(LAYERS) == [1, 2, 4]


def test_module_entry_point_help():
    out = subprocess.run(
        [sys.executable, "-m", "hsx.reference", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for flag in (
        "--model",
        "--dump-root",
        "--name-by",
        "--layers",
        "--dtype",
        "--skip-server-warmup",
        "--enable-return-hidden-states",
        "--synthetic",
        "--hidden-size",
        "--num-layers",
        "--vocab-size",
        "--prefill-us-per-token",
        "--max-batch",
        "--enable-fault-injection",
        "--enable-radix-cache",
        "--chunked-prefill-size",
        "/admin/faults",
    ):
        assert flag in out

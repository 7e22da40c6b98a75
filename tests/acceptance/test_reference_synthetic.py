"""Synthetic mode of the reference server: the content function, its speed, and real servers using it.

Two servers for the module: `big`, counter mode with the default shape (32 layers, hidden 4096,
vocab 32000, bfloat16) and warm-up, dumping to /dev/shm where there is one; and `batched`, rid mode
with --max-batch 8 and a simulated prefill time, small shapes.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from hsx.reference.dumper import Dumper, input_ids_sha256
from hsx.reference.server import WARMUP_INPUT_IDS
from hsx.reference.synthetic import TABLE_ROWS, SyntheticRunner, synthetic_hidden_states
from tests.support.procs import Process, free_port, hsx_command

BIG_LAYERS = [2, 16, 29, 32]
BATCHED_LAYERS = [0, 3]
BATCHED_ARGS = [
    "--synthetic",
    "--hidden-size",
    "64",
    "--num-layers",
    "8",
    "--vocab-size",
    "1000",
    "--name-by",
    "rid",
    "--layers",
    "0,3",
    "--max-batch",
    "8",
    "--prefill-us-per-token",
    "200",
    "--per-request-us",
    "1000",
    "--skip-server-warmup",
    "--enable-return-hidden-states",
]
DUMP_FILES = {"meta.json", "hidden_states.safetensors", "input_ids.safetensors", "done"}


def _shm_dir(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/dev/shm" if os.path.isdir("/dev/shm") else None))


# --- the content function ---------------------------------------------------------------------------


def _fmix32(h: int) -> int:
    m = 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & m
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & m
    return h ^ (h >> 16)


def documented(ids: list[int], layer: int, hidden: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """The module docstring's definition, written out independently in plain Python integers."""
    m = 0xFFFFFFFF
    table = (torch.rand(TABLE_ROWS, hidden, generator=torch.Generator().manual_seed(seed)) * 2 - 1).to(dtype)
    rows = []
    for t, token in enumerate(ids):
        prev = ids[t - 1] + 1 if t > 0 else 0
        h = ((token * 0x9E3779B1) & m) + ((prev * 0x85EBCA77) & m) + ((t * 0xC2B2AE3D) & m)
        h += (layer * 0x27D4EB2F + seed * 0x165667B1) & m
        rows.append(_fmix32(h & m) % TABLE_ROWS)
    return table[rows]


def test_matches_the_documented_definition():
    ids = [31999, 0, 5, 5, 5, 17, 123, 4095]
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        got = synthetic_hidden_states(ids, [2, 32], 48, dtype, seed=11)
        for layer in (2, 32):
            assert torch.equal(got[layer], documented(ids, layer, 48, dtype, seed=11))


def test_shapes_dtypes_and_values():
    ids = list(range(100, 400))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        hs = synthetic_hidden_states(ids, [29, 2, 16], 32, dtype)
        assert list(hs) == [29, 2, 16]
        for t in hs.values():
            assert t.shape == (300, 32) and t.dtype == dtype and t.is_contiguous()
            assert torch.isfinite(t).all() and t.min() >= -1 and t.max() <= 1
    assert synthetic_hidden_states([], [1], 8, torch.float32)[1].shape == (0, 8)


def test_deterministic_causal_and_varied():
    ids = torch.randint(0, 32000, (500,), generator=torch.Generator().manual_seed(3)).tolist()
    a = synthetic_hidden_states(ids, [2, 16], 64, torch.bfloat16)
    b = synthetic_hidden_states(ids, [16, 2], 64, torch.bfloat16)
    assert all(torch.equal(a[i], b[i]) for i in (2, 16))
    # Causal: a prefix's rows do not depend on what follows, so chunks and cache-trimmed dumps are slices.
    prefix = synthetic_hidden_states(ids[:123], [2], 64, torch.bfloat16)[2]
    assert torch.equal(prefix, a[2][:123])
    changed = synthetic_hidden_states(ids[:200] + [(ids[200] + 1) % 32000] + ids[201:], [2], 64, torch.bfloat16)[2]
    assert torch.equal(changed[:200], a[2][:200]) and not torch.equal(changed[200], a[2][200])
    # Layers, seeds and positions give different rows.
    assert not torch.equal(a[2], a[16])
    assert not torch.equal(a[2], synthetic_hidden_states(ids, [2], 64, torch.bfloat16, seed=1)[2])
    repeated = synthetic_hidden_states([7] * 64, [2], 64, torch.float32)[2]
    assert len({tuple(r.tolist()) for r in repeated}) > 50
    # Fresh tensors, not views of the cached table: a caller may modify them.
    a[2].zero_()
    assert torch.equal(b[2], synthetic_hidden_states(ids, [2], 64, torch.bfloat16)[2])


def test_speed_of_a_2000_token_sample(capsys):
    """Produce and write a 2,000-token, 4-layer, hidden-4096 bf16 sample (64 MB); print the figures.

    Two ways: the server's (SyntheticRunner.run, whose lazy rows Dumper streams into the file) and
    a caller's (synthetic_hidden_states' tensors, then Dumper). Both write the same file.
    """
    ids = torch.randint(0, 32000, (2000,), generator=torch.Generator().manual_seed(0)).tolist()
    runner = SyntheticRunner(layers=BIG_LAYERS)  # the defaults: hidden 4096, 32 layers, bfloat16
    root = _shm_dir("hsx-synth-speed-")
    times: dict[str, list[float]] = {"server": [], "tensors": []}
    try:
        dumper = Dumper(root, boot_id="speed", dtype_name="bfloat16", hidden_size=4096)
        for n in range(5):
            t0 = time.perf_counter()
            result = runner.run(ids, 0)
            dumper.write(f"s{n}", rid="s", counter=n, input_ids=ids, hidden_states=result.hidden_states)
            t1 = time.perf_counter()
            hs = synthetic_hidden_states(ids, BIG_LAYERS, 4096, torch.bfloat16)
            dumper.write(f"t{n}", rid="t", counter=n, input_ids=ids, hidden_states=hs)
            t2 = time.perf_counter()
            times["server"].append(1000 * (t1 - t0))
            times["tensors"].append(1000 * (t2 - t1))
            del hs
        path = root / "req_s0" / "hidden_states.safetensors"
        size = path.stat().st_size
        streamed, saved = load_file(path), load_file(root / "req_t0" / "hidden_states.safetensors")
        assert list(streamed) == [f"layer_{i}" for i in BIG_LAYERS]
        assert all(torch.equal(streamed[k], saved[k]) for k in saved)
    finally:
        shutil.rmtree(root)
    with capsys.disabled():
        for way, xs in times.items():
            print(
                f"\n[synthetic speed] {way}: 2000 tokens x 4 layers x 4096 bf16 ({size / 2**20:.0f} MiB) produced "
                f"and written to {root.parent}: median {statistics.median(xs):.1f} ms, min {min(xs):.1f} ms, "
                f"max {max(xs):.1f} ms over 5 runs",
                end="",
            )
        print()
    assert statistics.median(times["server"]) < 2000  # a sanity bound only: this machine's speed varies a lot


# --- real servers ------------------------------------------------------------------------------------


class SynServer:
    def __init__(self, base: Path, dump_root: Path, name: str, args: list[str]):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.dump_root = dump_root
        cmd = hsx_command() + ["reference-server", "--dump-root", str(dump_root), "--port", str(port), *args]
        self.proc = Process(cmd, base / f"{name}.log")
        self.client = httpx.Client(timeout=60, trust_env=False)

    def get(self, path: str) -> httpx.Response:
        return self.client.get(self.url + path)

    def generate(self, body: dict) -> httpx.Response:
        return self.client.post(self.url + "/generate", json=body)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    base = tmp_path_factory.mktemp("synthetic")
    shm = _shm_dir("hsx-synth-test-")
    started = {
        "big": SynServer(base, shm / "dumps", "big", ["--synthetic"]),
        "batched": SynServer(base, base / "dumps", "batched", BATCHED_ARGS),
    }
    try:
        for server in started.values():
            server.proc.wait_http(server.url + "/health", timeout=120)
        yield started
    finally:
        for server in started.values():
            server.client.close()
            server.proc.stop()
        shutil.rmtree(shm, ignore_errors=True)
    assert [s.proc.proc.returncode for s in started.values()] == [0, 0]


def read_dump(d: Path) -> tuple[dict, dict[str, torch.Tensor], list[int]]:
    assert {p.name for p in d.iterdir()} == DUMP_FILES
    meta = json.loads((d / "meta.json").read_text())
    ids = load_file(d / "input_ids.safetensors")["input_ids"].tolist()
    return meta, load_file(d / "hidden_states.safetensors"), ids


def test_info_reports_the_synthetic_shape(servers):
    big = servers["big"]
    assert big.get("/get_model_info").json() == {
        "model_path": "hsx-synthetic",
        "is_generation": True,
        "vocab_size": 32000,
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "dtype": "bfloat16",
        "max_position_embeddings": 131072,
    }
    info = big.get("/get_server_info").json()
    assert info["model_path"] == "hsx-synthetic" and info["disable_radix_cache"] is True
    assert info["hs_dump"]["layers"] == BIG_LAYERS and info["hs_dump"]["dtype"] == "bfloat16"
    assert info["hs_dump"]["name_by"] == "counter"
    assert info["synthetic"]["seed"] == 0 and info["synthetic"]["batching"] is False
    batched = servers["batched"].get("/get_server_info").json()
    assert batched["hs_dump"]["layers"] == BATCHED_LAYERS
    assert batched["synthetic"]["max_batch"] == 8 and batched["synthetic"]["batching"] is True


def test_warmup_health_checks_and_counter_as_in_model_mode(servers):
    big = servers["big"]
    warmup, tensors, ids = read_dump(big.dump_root / "req_0")
    assert warmup["counter"] == 0 and ids == WARMUP_INPUT_IDS
    assert tensors["layer_32"].shape == (len(WARMUP_INPUT_IDS), 4096)
    health, _, health_ids = read_dump(big.dump_root / "req_1")
    assert health["rid"].startswith("HEALTH_CHECK_") and health_ids == [0] and health["counter"] == 1
    assert big.get("/health").status_code == 200
    assert json.loads((big.dump_root / "req_2" / "meta.json").read_text())["counter"] == 2


def test_large_sample_matches_synthetic_hidden_states(servers, capsys):
    big = servers["big"]
    prompt = torch.randint(0, 32000, (2000,), generator=torch.Generator().manual_seed(5)).tolist()
    before = {p.name for p in big.dump_root.iterdir()}
    started = time.perf_counter()
    reply = big.generate({"input_ids": prompt, "rid": "big-1", "sampling_params": {"max_new_tokens": 4}})
    elapsed = time.perf_counter() - started
    assert reply.status_code == 200, reply.text
    assert len(reply.json()["output_ids"]) == 4
    (name,) = {p.name for p in big.dump_root.iterdir()} - before
    meta, tensors, ids = read_dump(big.dump_root / name)
    assert (meta["num_tokens"], meta["hidden_size"], meta["layers"], meta["rid"]) == (2000, 4096, BIG_LAYERS, "big-1")
    assert ids == prompt and meta["input_ids_sha256"] == input_ids_sha256(prompt)
    expected = synthetic_hidden_states(prompt, BIG_LAYERS, 4096, torch.bfloat16)
    assert all(torch.equal(tensors[f"layer_{i}"], expected[i]) for i in BIG_LAYERS)
    with capsys.disabled():
        print(f"\n[synthetic server] one 2000-token /generate with its 64 MB dump: {1000 * elapsed:.0f} ms round trip")


def test_rid_mode_dumps_and_return_hidden_states(servers):
    server = servers["batched"]
    prompts = [[1, 2, 3, 4], [999, 0, 998]]
    reply = server.generate(
        {
            "input_ids": prompts,
            "rid": ["s-a", "s-b"],
            "return_hidden_states": True,
            "sampling_params": {"max_new_tokens": 2},
        }
    )
    assert reply.status_code == 200, reply.text
    for prompt, rid, body in zip(prompts, ["s-a", "s-b"], reply.json()):
        meta, tensors, ids = read_dump(server.dump_root / f"req_{rid}")
        assert meta["rid"] == rid and ids == prompt and meta["layers"] == BATCHED_LAYERS
        expected = synthetic_hidden_states(prompt, BATCHED_LAYERS + [8], 64, torch.bfloat16)
        assert all(torch.equal(tensors[f"layer_{i}"], expected[i]) for i in BATCHED_LAYERS)
        # The last layer is not dumped here, yet return_hidden_states still gets it.
        assert torch.equal(torch.tensor(body["meta_info"]["hidden_states"]), expected[8].float())
        assert body["meta_info"]["id"] == rid and len(body["output_ids"]) == 2


def test_batching_raises_throughput_with_concurrent_rid_requests(servers, capsys):
    server = servers["batched"]
    n, tokens = 8, 400  # each request simulates 400 * 200 us + 1 ms = 81 ms of prefill

    def send(rid: str, client: httpx.Client) -> None:
        prompt = [(k * 7 + len(rid)) % 1000 for k in range(tokens)]
        reply = client.post(
            server.url + "/generate", json={"input_ids": prompt, "rid": rid, "sampling_params": {"max_new_tokens": 0}}
        )
        assert reply.status_code == 200, reply.text

    started = time.perf_counter()
    for k in range(n):
        send(f"serial-{k}", server.client)
    serial = time.perf_counter() - started

    clients = [httpx.Client(timeout=60, trust_env=False) for _ in range(n)]
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            send(f"concurrent-{k}", clients[k])
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(n)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    concurrent = time.perf_counter() - started
    for c in clients:
        c.close()
    assert not errors, errors

    stats = server.get("/get_server_info").json()["synthetic"]["stats"]
    with capsys.disabled():
        print(
            f"\n[synthetic batching] {n} x {tokens}-token requests: serial {serial * 1000:.0f} ms "
            f"({n / serial:.1f} req/s), concurrent {concurrent * 1000:.0f} ms ({n / concurrent:.1f} req/s), "
            f"speed-up {serial / concurrent:.1f}x; batcher stats {stats}"
        )
    assert stats["largest_batch"] > 1
    assert serial / concurrent > 1.5
    for k in range(n):
        meta, _, _ = read_dump(server.dump_root / f"req_concurrent-{k}")
        assert meta["num_tokens"] == tokens and meta["rid"] == f"concurrent-{k}"


@pytest.mark.parametrize(
    "argv",
    [
        ["--hidden-size", "8"],
        ["--max-batch", "4"],
        ["--synthetic", "--model", "/x"],
        ["--synthetic", "--chunked-prefill-size", "0"],
        ["--synthetic", "--device", "cpu"],
        ["--device", "no-such-device"],
        ["--device", "cuda:99"],  # no CUDA here, or not that many devices
    ],
)
def test_usage_errors(argv):
    out = subprocess.run([sys.executable, "-m", "hsx.reference", *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "error:" in out.stderr

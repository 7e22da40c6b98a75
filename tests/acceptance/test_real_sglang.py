"""Jobs against a real SGLang 0.5.23 (its CPU engine), not the imitation: plugin mode as
deploy/sglang/README.md launches it, and the plugin-free mode that returns the rows in the answer.

The server runs in its own environment (tests/support/engines/sglang-env.sh builds it once per
machine); its CUDA-only kernel package is replaced by a stand-in the test writes itself (the one
kernel a plain CPU serve calls, the others raise). The model is a tiny random float32 Llama made
here, and every stored tensor is compared with a transformers recomputation of its own ids.
"""

from __future__ import annotations

import random
import subprocess
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from hsx.manifest import load_manifest, read_sample
from tests.support.procs import Process, free_port
from tests.support.stack import start_service, start_stock_sglang

pytestmark = pytest.mark.slow  # a real SGLang starts in 30-90 s, once per test

ENV_SCRIPT = Path(__file__).resolve().parents[1] / "support" / "engines" / "sglang-env.sh"
HIDDEN, NUM_LAYERS, VOCAB = 256, 8, 1000
AUX = [2, NUM_LAYERS // 2, NUM_LAYERS - 3]

# The one kernel a plain CPU serve calls (mem_cache/allocation.py): for each request r, the slots
# start_offset[r]:end_offset[r] of its row in req_to_token get the next entries of out_cache_loc.
KERNEL_STANDIN = '''
"""Test-only stand-in for SGLang's CUDA kernel package on a CPU-only host."""


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, *_a, **_k):
    pos = 0
    for r in range(len(req_pool_indices)):
        a, b = int(start_offset[r]), int(end_offset[r])
        req_to_token[int(req_pool_indices[r]), a:b] = out_cache_loc[pos : pos + b - a]
        pos += b - a


def __getattr__(name):
    def unavailable(*_a, **_k):
        raise NotImplementedError(f"sgl_kernel.{name} is not available on this host")

    return unavailable
'''


@pytest.fixture(scope="module")
def sglang_python() -> str:
    done = subprocess.run(["bash", str(ENV_SCRIPT)], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=512,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=2048,
        torch_dtype="float32",
    )
    m = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("model")
    m.save_pretrained(path)
    return path, m


def start_sglang(
    python: str,
    tmp: Path,
    model_path: Path,
    flags: list[str],
    env: dict[str, str],
    dtype: str = "float32",
    port: int | None = None,
) -> tuple[str, Process]:
    standin = tmp / "standin" / "sgl_kernel"
    standin.mkdir(parents=True, exist_ok=True)
    (standin / "__init__.py").write_text(textwrap.dedent(KERNEL_STANDIN))
    port = port or free_port()
    args = [python, "-m", "sglang.launch_server", "--model-path", str(model_path), "--host", "127.0.0.1"]
    args += ["--port", str(port), "--device", "cpu", "--dtype", dtype, "--mem-fraction-static", "0.3"]
    args += ["--max-total-tokens", "65536", "--skip-tokenizer-init", "--chunked-prefill-size", "-1", *flags]
    base_env = {"PYTHONPATH": str(tmp / "standin"), "SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1"}
    proc = Process(args, tmp / f"sglang-{port}.log", env={**base_env, **env})
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(url + "/health", timeout=400)
    except BaseException:
        proc.stop()
        raise
    return url, proc


def truth(m: torch.nn.Module, ids: list[int], layers: list[int]) -> dict[int, torch.Tensor]:
    with torch.no_grad():
        hs = m(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return {i: hs[i][0] for i in layers}


def make_items(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": f"s{i}", "input_ids": [rng.randrange(VOCAB) for _ in range(rng.randint(5, 80))]} for i in range(n)]


def run_and_check(svc, m, layers: list[int], n: int, seed: int, dtype: str = "float32") -> tuple[dict, float]:
    """A job of n samples; every stored tensor against the (float32) recomputation. Returns (job, max abs diff)."""
    items = make_items(n, seed)
    job = svc.wait_job(svc.post_job({"samples": items}).json()["id"], timeout=600)
    return job, check_stored(svc, m, job, items, layers, dtype)


def check_stored(svc, m, job: dict, items: list[dict], layers: list[int], dtype: str = "float32") -> float:
    """The max abs difference of every stored tensor from the recomputation of its sample's ids."""
    assert job["state"] == "succeeded", job
    folder = svc.output_root / job["id"]
    manifest = load_manifest(folder)
    assert manifest.layers == layers and manifest.dtype == dtype
    worst = 0.0
    for s in items:
        got = read_sample(folder, manifest, s["id"])
        assert got["input_ids"].tolist() == s["input_ids"]
        for i, want in truth(m, s["input_ids"], layers).items():
            worst = max(worst, (got[f"layer_{i}"].float() - want).abs().max().item())
    return worst


def test_plugin_mode_stores_every_sample_exactly(tmp_path, sglang_python, model):
    model_path, m = model
    dumps = tmp_path / "dumps"
    url, server = start_sglang(
        sglang_python,
        tmp_path,
        model_path,
        ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3", "--disable-radix-cache"],
        {"SGLANG_PLUGINS": "hsx_dump", "HSX_DUMP_ROOT": str(dumps)},
    )
    # --log-level debug: the log then holds a line for each request hsx sends to the model server.
    svc = start_service(
        tmp_path, f"sqlite:///{tmp_path / 'hsx.db'}", backend_url=url, dump_root=dumps, extra=["--log-level", "debug"]
    )
    try:
        job, worst = run_and_check(svc, m, [*AUX, NUM_LAYERS], n=30, seed=1)
        assert worst <= 1e-5, worst
        assert svc.get("/healthz").json()["writer"]["server"]["identity"] == "ids"
        samples = svc.get(f"/v1/jobs/{job['id']}/samples?limit=100").json()["data"]
        assert [s["attempts"] for s in samples] == [1] * 30, "no attempt was spent on a refusal"
        asked = svc.proc.log()
        assert "/model_info " in asked and "/server_info " in asked, "SGLang 0.5.23's current names"
        assert "/get_model_info" not in asked and "/get_server_info" not in asked, "not the deprecated ones"
    finally:
        svc.stop()
        server.stop()


def test_plugin_free_mode_returns_the_last_layer_in_the_answer(tmp_path, sglang_python, model):
    model_path, m = model
    url, server = start_sglang(
        sglang_python, tmp_path, model_path, ["--enable-return-hidden-states", "--disable-radix-cache"], {}
    )
    svc = start_service(tmp_path, f"sqlite:///{tmp_path / 'hsx.db'}", backend_url=url, dump_root=tmp_path / "d")
    try:
        _, worst = run_and_check(svc, m, [NUM_LAYERS], n=20, seed=2)
        assert worst <= 1e-5, worst
        assert svc.get("/healthz").json()["writer"]["server"]["identity"] == "response"
    finally:
        svc.stop()
        server.stop()


def test_dtype_auto_on_a_float32_checkpoint_is_recorded_as_what_sglang_runs(tmp_path, sglang_python, model):
    """SGLang runs a float32 checkpoint in float16 under --dtype auto: the shards say float16, and hold it."""
    model_path, m = model
    url, server = start_sglang(
        sglang_python, tmp_path, model_path, ["--enable-return-hidden-states", "--disable-radix-cache"], {}, "auto"
    )
    svc = start_service(tmp_path, f"sqlite:///{tmp_path / 'hsx.db'}", backend_url=url, dump_root=tmp_path / "d")
    try:
        _, worst = run_and_check(svc, m, [NUM_LAYERS], n=5, seed=3, dtype="float16")
        assert worst <= 0.05, worst  # float16 arithmetic against a float32 recomputation
    finally:
        svc.stop()
        server.stop()


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


def test_plugin_mode_beside_another_client_with_the_radix_cache_on_through_a_kill_and_restart(
    tmp_path, sglang_python, model
):
    """SGLang's defaults (warm-up, radix cache on), four requests in flight, another client and health
    checks all along; the server SIGKILLed mid-job and started again: every sample stored, exact."""
    model_path, m = model
    dumps = tmp_path / "dumps"
    flags = ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3"]
    env = {"SGLANG_PLUGINS": "hsx_dump", "HSX_DUMP_ROOT": str(dumps)}
    port = free_port()
    url, server = start_sglang(sglang_python, tmp_path, model_path, flags, env, port=port)
    svc = start_service(
        tmp_path, f"sqlite:///{tmp_path / 'hsx.db'}", backend_url=url, dump_root=dumps, extra=["--max-in-flight", "4"]
    )
    other = OtherClient(url)
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
        url, server = start_sglang(sglang_python, tmp_path, model_path, flags, env, port=port)
        job = svc.wait_job(job_id, timeout=600)
        # Prefill batches of several requests round differently from one prompt alone: within 1e-5.
        assert check_stored(svc, m, job, items, [*AUX, NUM_LAYERS]) <= 1e-5
        assert other.sent > 0
        spent = [s["attempts"] for s in svc.get(f"/v1/jobs/{job_id}/samples?limit=200").json()["data"]]
        assert max(spent) == 1, "the restart spent no attempt, and no prompt was served from the cache"
    finally:
        other.stop.set()
        svc.stop()
        server.stop()


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


def shape(value) -> list[int]:
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


def test_the_imitation_answers_as_the_real_server_does(tmp_path, sglang_python, model):
    """The same requests to a real SGLang and to `hsx reference-server --stock-sglang` launched alike:
    the same status codes, and in each answer the same fields hsx reads; the same server settings."""
    model_path, _ = model
    flags = ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3", "--disable-radix-cache"]
    flags += ["--skip-server-warmup"]
    real_url, real = start_sglang(
        sglang_python, tmp_path, model_path, flags, {"SGLANG_PLUGINS": "hsx_dump", "HSX_DUMP_ROOT": str(tmp_path / "r")}
    )
    imitation = start_stock_sglang(tmp_path, model_path, dump_root=tmp_path / "i", flags=[*flags, "--dtype", "float32"])
    try:
        with httpx.Client(timeout=60) as c:
            for what, body in REQUESTS.items():
                body = {"sampling_params": {"max_new_tokens": 1}} | body
                got = [answer_view(c.post(url + "/generate", json=body)) for url in (real_url, imitation.url)]
                assert got[0] == got[1], (what, got)
            infos = [c.get(url + "/server_info").json() for url in (real_url, imitation.url)]
            for field in SERVER_FIELDS:
                assert infos[0].get(field) == infos[1].get(field), (field, infos[0].get(field), infos[1].get(field))
            models = [c.get(url + "/model_info").json() for url in (real_url, imitation.url)]
            assert models[0]["model_path"] == models[1]["model_path"] == str(model_path)
        for rid in ("hsx-p1", "hsx-b_0", "hsx-b_1"):
            assert (tmp_path / "r" / f"req_{rid}" / "done").exists() == (
                tmp_path / "i" / f"req_{rid}" / "done"
            ).exists()
    finally:
        imitation.proc.stop()
        real.stop()

"""hsx's vLLM connector (deploy/vllm) in a real vLLM 0.32.0 CPU server, launched as its README says:
each request's file holds its prompt and the residual stream of every asked layer, exactly as a
float32 transformers recomputation gives them, alone and under concurrent requests."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from tests.support.real_vllm import VLLM, read_hidden_states, truth, vllm_python
from tests.support.tiny_llama import HIDDEN, NUM_LAYERS, VOCAB, make_model

pytestmark = pytest.mark.slow  # one real vLLM for the module: 30-95 s to start

# The embedding output, inner layers, and L (before the final norm), in vLLM's numbering.
LAYERS = [0, 2, NUM_LAYERS // 2, NUM_LAYERS - 3, NUM_LAYERS]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VLLM, torch.nn.Module]]:
    tmp = tmp_path_factory.mktemp("vllm")
    m = make_model(tmp / "model", "float32")
    python = vllm_python()
    began = time.monotonic()
    server = VLLM(python, tmp, tmp / "model", LAYERS, tmp / "storage").start()
    print(f"vLLM ready after {time.monotonic() - began:.1f} s")
    yield server, m
    server.stop()


def complete(server: VLLM, ids: list[int], request_id: str) -> tuple[str, float]:
    """One prompt of token ids, one output token: (the file the answer names, seconds taken)."""
    began = time.monotonic()
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": str(server.model_path), "prompt": ids, "max_tokens": 1},
        headers={"X-Request-Id": request_id},
        timeout=120,
    )
    took = time.monotonic() - began
    assert r.status_code == 200, r.text
    path = r.json()["kv_transfer_params"]["hidden_states_path"]
    # The file itself usually comes after the answer (it is written at the engine's next step), but
    # its lock already exists, held by the server: the server makes it when it schedules the request.
    assert Path(path + ".lock").exists()
    return path, took


def check_file(server: VLLM, m: torch.nn.Module, path: str, ids: list[int], request_id: str) -> float:
    """The file is the request's own, under the storage folder, and right: its max abs difference."""
    assert Path(path).parent == server.storage
    # vLLM's request id: cmpl-{X-Request-Id}-{prompt index}-{random suffix}
    assert Path(path).name.startswith(f"cmpl-{request_id}-0-") and path.endswith(".safetensors")
    got = read_hidden_states(path)
    assert got["token_ids"].dtype == torch.int64 and got["token_ids"].tolist() == ids
    hs = got["hidden_states"]
    assert hs.dtype == torch.float32 and hs.shape == (len(ids), len(LAYERS), HIDDEN)
    worst = 0.0
    for j, (k, want) in enumerate(truth(m, ids, LAYERS).items()):
        diff = (hs[:, j] - want).abs().max().item()
        assert diff <= 1e-4, (k, diff)
        worst = max(worst, diff)
    return worst


def test_one_request_writes_its_prompts_hidden_states(served):
    server, m = served
    ids = [random.Random(1).randrange(VOCAB) for _ in range(37)]
    path, took = complete(server, ids, "one")
    worst = check_file(server, m, path, ids, "one")
    print(f"{len(ids)} tokens: {took * 1000:.0f} ms, max abs difference {worst:.3g}")


def test_concurrent_requests_each_get_their_own_correct_file(served):
    server, m = served
    rng = random.Random(2)
    prompts = {f"c{i}": [rng.randrange(VOCAB) for _ in range(rng.randint(3, 300))] for i in range(8)}
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = dict(zip(prompts, pool.map(lambda rid: complete(server, prompts[rid], rid), prompts)))
    assert len({path for path, _ in answers.values()}) == len(prompts)
    for rid, (path, _) in answers.items():
        check_file(server, m, path, prompts[rid], rid)
    print("concurrent: " + ", ".join(f"{len(prompts[r])} tokens {t * 1000:.0f} ms" for r, (_, t) in answers.items()))


def test_a_repeated_prompt_is_written_again_in_full(served):
    # Prefix caching is on by default: a repeat is served from cached blocks, and its file must still
    # hold every row (the cached blocks hold the hidden states too).
    server, m = served
    ids = [random.Random(3).randrange(VOCAB) for _ in range(200)]
    first, _ = complete(server, ids, "again")
    second, _ = complete(server, ids, "again")
    assert first != second  # vLLM makes each request id unique, so a repeat never overwrites
    for path in (first, second):
        check_file(server, m, path, ids, "again")

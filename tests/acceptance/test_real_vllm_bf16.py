"""A real vLLM 0.32.0 (its CPU build) serving a bfloat16 model, each test on a server of its own whose first
request is the one under test.

On a CPU with AMX, vLLM's bfloat16 attention runs AMX kernels without asking Linux for the AMX tile state
first; only oneDNN asks, for prompts long enough to get its AMX kernels. A 4-token first request killed the
worker with SIGILL (`Fatal Python error: Illegal instruction` in `cpu_attention_with_kv_cache`), a 16-token
one did not. So hsx's probe is 16 tokens, and hsx's connector asks for the AMX state in the worker before
its first forward pass. Where the CPU has no AMX neither matters, and these tests pass all the same.

bfloat16 rows are not bit-equal to a transformers recomputation (other CPU kernels round differently: up to
about 0.16 at magnitude 7 in the deeper layers), so each sample's stored rows are checked to be nearer its
own recomputation than any other sample's, and the embedding output (layer 0, a lookup) to be exact."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from hsx.manifest import read_sample
from tests.support.real_vllm import (
    HSX_CONNECTOR,
    STOCK_ON_CPU,
    VLLM,
    check_final_norm_by_hsx,
    items,
    read_hidden_states,
    stored,
    truth,
    vllm_python,
)
from tests.support.stack import start_service
from tests.support.tiny_llama import NUM_LAYERS, VOCAB, make_model

pytestmark = pytest.mark.slow  # two real vLLM servers: 30-95 s each to start

LAYERS = [0, 2, NUM_LAYERS // 2, NUM_LAYERS - 3, NUM_LAYERS]
LENGTH = 24  # every sample as long, so that each can be held against every other's recomputation


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("model")
    return path, make_model(path, "bfloat16").to(torch.bfloat16)


@pytest.fixture
def fresh(request: pytest.FixtureRequest, tmp_path: Path, model: tuple[Path, torch.nn.Module]) -> Iterator[VLLM]:
    """A bfloat16 server with the connector the test names, that has answered no request yet."""
    tmp = tmp_path / "vllm"
    tmp.mkdir()
    s = VLLM(vllm_python(), tmp, model[0], LAYERS, tmp / "dumps", dtype="bfloat16", connector=request.param)
    s.start()
    yield s
    s.stop()


def nearest_own(rows: dict[str, torch.Tensor], ids: dict[str, list[int]], m: torch.nn.Module) -> None:
    """Each sample's rows (sample -> [tokens, layers, hidden]) nearer its own recomputation than any other's;
    layer 0 exact. Prints the largest difference from its own and the smallest from another's."""
    worst_own, best_other = 0.0, float("inf")
    want = {name: torch.stack(list(truth(m, ids[name], LAYERS).values()), dim=1).float() for name in ids}
    for name, got in rows.items():
        assert torch.equal(got[:, 0].float(), want[name][:, 0]), f"{name}: the embedding output is a lookup"
        own = (got.float() - want[name]).abs().max().item()
        others = min((got.float() - w).abs().max().item() for other, w in want.items() if other != name)
        assert own < others, (name, own, others)
        assert own <= 0.5, (name, own)
        worst_own, best_other = max(worst_own, own), min(best_other, others)
    print(f"bfloat16, {len(rows)} samples: own recomputation within {worst_own:.3g}, others' at least {best_other:.3g}")


@pytest.mark.parametrize("fresh", [STOCK_ON_CPU], indirect=True, ids=["stock-files"])
def test_hsx_probe_as_a_servers_first_request_and_a_job_in_bfloat16(tmp_path, fresh, model):
    """The connector here does nothing about AMX (vLLM's own, its copy made CPU-safe): only the probe's length
    keeps the worker alive. The service's probe is the server's first request."""
    svc = start_service(
        tmp_path,
        f"sqlite:///{tmp_path / 'hsx.db'}",
        backend_url=fresh.url,
        dump_root=fresh.storage,
        extra=["--source", "vllm", "--capture-layers", ",".join(map(str, LAYERS))],
    )
    try:
        samples = items(12, seed=5, lengths=(LENGTH, LENGTH))
        job = svc.wait_job(svc.post_job({"samples": samples, "layers": LAYERS}).json()["id"], timeout=600)
        folder, manifest = stored(svc, job, LAYERS, "bfloat16")
        rows = {}
        for s in samples:
            got = read_sample(folder, manifest, s["id"])
            assert got["input_ids"].tolist() == s["input_ids"]
            rows[s["id"]] = torch.stack([got[f"layer_{k}"] for k in LAYERS], dim=1)
        nearest_own(rows, {s["id"]: s["input_ids"] for s in samples}, model[1])
        # The default job reads L after the final norm, which hsx applies to vLLM's: within one unit in the
        # last place of transformers' norm module (in bfloat16) applied to the same stored pre-norm rows.
        post = svc.wait_job(svc.post_job({"samples": samples}).json()["id"], timeout=600)
        for _, after, before in check_final_norm_by_hsx(svc, post, job, samples, fresh.model_path):
            with torch.no_grad():
                normed = model[1].model.norm(before)
            ulp = torch.finfo(torch.bfloat16).eps * normed.float().abs()
            assert bool(((after.float() - normed.float()).abs() <= ulp).all())
    finally:
        svc.stop()


@pytest.mark.parametrize("fresh", [HSX_CONNECTOR], indirect=True, ids=["hsx-connector"])
def test_hsx_connector_survives_a_4_token_first_request(fresh, model):
    rng = random.Random(6)
    prompts = {f"short{i}": [rng.randrange(VOCAB) for _ in range(4)] for i in range(4)}
    rows = {}
    for rid, ids in prompts.items():  # the first of them is the server's first request
        r = httpx.post(
            fresh.url + "/v1/completions",
            json={"model": str(fresh.model_path), "prompt": ids, "max_tokens": 1},
            headers={"X-Request-Id": rid},
            timeout=120,
        )
        assert r.status_code == 200, (r.text, fresh.log()[-3000:])
        got = read_hidden_states(r.json()["kv_transfer_params"]["hidden_states_path"])
        assert got["token_ids"].tolist() == ids and got["hidden_states"].dtype == torch.bfloat16
        rows[rid] = got["hidden_states"]
    nearest_own(rows, prompts, model[1])

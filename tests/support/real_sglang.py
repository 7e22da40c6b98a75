"""A real SGLang 0.5.23 (its CPU engine) for the engine tests, and what they check its jobs with.

The server runs in its own environment (tests/support/engines/sglang-env.sh builds it once per
machine, outside the checkout); its CUDA-only kernel package is replaced by a stand-in written
here (the one kernel a plain CPU serve calls, the others raise). The model is a tiny random Llama
made here, and every stored tensor is compared with a transformers recomputation of its own ids.
Start-up is 30-95 s on 2 cores, so each test module shares one server (a module-scoped fixture).
"""

from __future__ import annotations

import random
import subprocess
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hsx.manifest import load_manifest, read_sample
from tests.support.engine_server import EngineServer
from tests.support.tiny_llama import NUM_LAYERS, VOCAB

ENV_SCRIPT = Path(__file__).resolve().parent / "engines" / "sglang-env.sh"
AUX = [2, NUM_LAYERS // 2, NUM_LAYERS - 3]  # EAGLE-3's layers for 8 layers, as hsx numbers them
PLUGIN_FLAGS = ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3"]

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

# A plugin that fails while SGLang's loader imports it: SGLang logs "Failed to load plugin" and
# serves on, undumped, which is what hsx must notice by itself.
BROKEN_PLUGIN = 'raise ImportError("hsx_sglang cannot be imported here")\n'


def sglang_python() -> str:
    """The real SGLang environment's python, built on first use."""
    done = subprocess.run(["bash", str(ENV_SCRIPT)], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


@dataclass
class SGLang(EngineServer):
    """One real SGLang server; `restart()` starts it again on the same port (after a kill, say)."""

    flags: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    dtype: str = "float32"
    broken_plugin: bool = False

    def command(self) -> tuple[list[str], dict[str, str]]:
        paths = self.tmp / "pythonpath"
        (paths / "sgl_kernel").mkdir(parents=True, exist_ok=True)
        (paths / "sgl_kernel" / "__init__.py").write_text(textwrap.dedent(KERNEL_STANDIN))
        if self.broken_plugin:
            (paths / "hsx_sglang").mkdir(exist_ok=True)
            (paths / "hsx_sglang" / "__init__.py").write_text(BROKEN_PLUGIN)
        args = [self.python, "-m", "sglang.launch_server", "--model-path", str(self.model_path)]
        args += ["--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu", "--dtype", self.dtype]
        args += ["--mem-fraction-static", "0.3", "--max-total-tokens", "65536", "--skip-tokenizer-init"]
        args += ["--chunked-prefill-size", "-1", *self.flags]
        env = {"PYTHONPATH": str(paths), "SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "1", **self.env}
        return args, env


def truth(m: torch.nn.Module, ids: list[int], layers: list[int]) -> dict[int, torch.Tensor]:
    with torch.no_grad():
        hs = m(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return {i: hs[i][0] for i in layers}


def make_items(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"id": f"s{i}", "input_ids": [rng.randrange(VOCAB) for _ in range(rng.randint(5, 80))]} for i in range(n)]


def run_and_check(
    svc: Any, m: torch.nn.Module, layers: list[int], n: int, seed: int, dtype: str = "float32"
) -> tuple[dict[str, Any], float]:
    """A job of n samples; every stored tensor against the (float32) recomputation. Returns (job, max abs diff)."""
    items = make_items(n, seed)
    job = svc.wait_job(svc.post_job({"samples": items, "layers": layers}).json()["id"], timeout=600)
    return job, check_stored(svc, m, job, items, layers, dtype)


def check_stored(
    svc: Any, m: torch.nn.Module, job: dict[str, Any], items: list[dict[str, Any]], layers: list[int], dtype: str
) -> float:
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
            assert str(got[f"layer_{i}"].dtype) == f"torch.{dtype}"
            worst = max(worst, (got[f"layer_{i}"].float() - want).abs().max().item())
    return worst

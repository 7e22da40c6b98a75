"""A real vLLM 0.32.0 (its CPU build) with hsx's hidden-states connector, for the engine tests.

The server runs in its own environment (tests/support/engines/vllm-env.sh builds it once per
machine, outside the checkout, and installs deploy/vllm into it), launched as deploy/vllm/README.md
says. The model is a tiny random Llama made here (head_dim 64: vLLM's CPU attention rejects smaller
heads). Start-up is 30-95 s on 2 cores, so each test module shares one server.
"""

from __future__ import annotations

import fcntl
import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.support.engine_server import EngineServer
from tests.support.tiny_llama import NUM_LAYERS

ENV_SCRIPT = Path(__file__).resolve().parent / "engines" / "vllm-env.sh"
CONNECTOR, CONNECTOR_MODULE = "HiddenStatesConnector", "hsx_vllm.connector"


def vllm_python() -> str:
    """The real vLLM environment's python, built on first use."""
    done = subprocess.run(["bash", str(ENV_SCRIPT)], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def launch_args(python: str, model: Path, port: int, dtype: str, layers: list[int], storage: Path) -> list[str]:
    """The server's command line, as deploy/vllm/README.md gives it."""
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}},
    }
    transfer = {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    args = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    args += ["--host", "127.0.0.1", "--port", str(port), "--dtype", dtype]
    args += ["--max-model-len", "2048", "--enforce-eager", "--skip-tokenizer-init"]
    args += ["--speculative-config", json.dumps(speculative), "--kv-transfer-config", json.dumps(transfer)]
    return args


@dataclass
class VLLM(EngineServer):
    """One real vLLM server writing hidden states of `layers` under `storage`; `restart()` starts
    it again on the same port (after a kill, say)."""

    layers: list[int] = field(default_factory=list)
    storage: Path = Path()
    dtype: str = "float32"
    env: dict[str, str] = field(default_factory=dict)

    def command(self) -> tuple[list[str], dict[str, str]]:
        args = launch_args(self.python, self.model_path, self.port, self.dtype, self.layers, self.storage)
        # 1 GiB of KV cache is plenty for the tiny model (the CPU build's default is far more).
        return args, {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", **self.env}


def read_hidden_states(path: str) -> dict[str, torch.Tensor]:
    """A file the connector wrote, read once its write has ended: the server holds an exclusive
    flock on `<path>.lock` from scheduling until the write ends, and the answer naming the file
    can come first."""
    with open(path + ".lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        return load_file(path)


def truth(m: torch.nn.Module, ids: list[int], layers: list[int]) -> dict[int, torch.Tensor]:
    """vLLM's layer k recomputed by transformers: the residual stream after k decoder layers. For
    k < L that is transformers' `hidden_states[k]`; for k = L it is the last decoder layer's output,
    before the final norm (transformers' `hidden_states[L]` is after it), taken with a hook."""
    last: list[torch.Tensor] = []

    def keep(_module: torch.nn.Module, _args: object, out: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
        last.append(out[0] if isinstance(out, tuple) else out)

    hook = m.model.layers[-1].register_forward_hook(keep)
    try:
        with torch.no_grad():
            hs = m(torch.tensor([ids]), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    return {k: (last[0] if k == NUM_LAYERS else hs[k])[0] for k in layers}

"""A real vLLM 0.32.0 (its CPU build) with a hidden-states connector, for the engine tests.

The server runs in its own environment (tests/support/engines/vllm-env.sh builds it once per
machine, outside the checkout, and installs deploy/vllm into it), launched as deploy/vllm/README.md
says: with hsx's connector (HSX_CONNECTOR), or with vLLM's own connector's files and nothing else
(STOCK_ON_CPU: vLLM's `ExampleHiddenStatesConnector` with only its CUDA-only copy swapped for one that
runs on the CPU, deploy/vllm's `CpuCopyConnector`; vLLM's class itself kills the CPU engine at the first
finished request). The model is a tiny random Llama made here (head_dim 64: vLLM's CPU attention rejects smaller
heads). Start-up is 30-95 s on 2 cores, so each test module shares one server.
"""

from __future__ import annotations

import fcntl
import json
import random
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from hsx.layers import eagle3_capture_layers
from hsx.manifest import load_manifest, read_sample
from tests.support.engine_server import EngineServer
from tests.support.stack import Service
from tests.support.tiny_llama import NUM_LAYERS, VOCAB, make_model

ENV_SCRIPT = Path(__file__).resolve().parent / "engines" / "vllm-env.sh"
# (class, module) of a connector
HSX_CONNECTOR = ("HiddenStatesConnector", "hsx_vllm.connector")
STOCK_ON_CPU = ("CpuCopyConnector", "hsx_vllm.connector")
# vLLM's own class, as speculators users launch it (a GPU host's): on this CPU-only one it kills the engine
VLLMS_OWN = (
    "ExampleHiddenStatesConnector",
    "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector",
)
# EAGLE-3's three aux layers and the last, which vLLM gives before the final norm
EAGLE3_LAYERS = eagle3_capture_layers(NUM_LAYERS)


def tiny_model(folder: Path) -> tuple[Path, torch.nn.Module]:
    """The tests' tiny float32 Llama saved in `folder`: its path (what vLLM serves) and the model (the truth)."""
    return folder, make_model(folder)


def vllm_python() -> str:
    """The real vLLM environment's python, built on first use."""
    done = subprocess.run(["bash", str(ENV_SCRIPT)], capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def launch_args(
    python: str,
    model: Path,
    port: int,
    dtype: str,
    layers: list[int],
    storage: Path,
    connector: tuple[str, str] = HSX_CONNECTOR,
) -> list[str]:
    """The server's command line, as deploy/vllm/README.md gives it."""
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}},
    }
    transfer = {
        "kv_connector": connector[0],
        "kv_connector_module_path": connector[1],
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
    connector: tuple[str, str] = HSX_CONNECTOR

    def command(self) -> tuple[list[str], dict[str, str]]:
        args = launch_args(
            self.python, self.model_path, self.port, self.dtype, self.layers, self.storage, self.connector
        )
        # 1 GiB of KV cache is plenty for the tiny model (the CPU build's default is far more).
        return args, {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", **self.env}


VLLM_README = Path(__file__).resolve().parents[2] / "deploy" / "vllm" / "README.md"


@dataclass(frozen=True)
class ReadmeLaunch:
    """deploy/vllm/README.md's "On a CPU host" block, as written: the server's environment and command, and
    the layers hsx is told (`hsx serve --capture-layers`)."""

    env: dict[str, str]
    command: list[str]
    capture_layers: list[int]

    @classmethod
    def read(cls) -> ReadmeLaunch:
        section = VLLM_README.read_text().split("### On a CPU host", 1)[1]
        block = section.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
        install, rest = block.split("\n", 1)
        # vllm-env.sh installs the package the same way, so the block's first line is what the tests run
        assert install.split("#")[0].split() == ["pip", "install", "./deploy/vllm"], install
        lexer = shlex.shlex(rest, posix=True, punctuation_chars="&")
        lexer.whitespace_split = True
        tokens = list(lexer)
        server, hsx = tokens[: tokens.index("&")], tokens[tokens.index("&") + 1 :]
        assignments = [t for t in server if "=" in t and t.split("=", 1)[0].isupper()]
        env = dict(a.split("=", 1) for a in assignments)
        capture = hsx[hsx.index("--capture-layers") + 1]
        return cls(env, server[len(assignments) :], [int(x) for x in capture.split(",")])

    def args(self, python: str, model: Path, port: int, storage: Path, connector: tuple[str, str]) -> list[str]:
        """The command with this machine's python, model, port and folder put in, nothing else changed; it
        must launch `connector`."""
        args = list(self.command)
        assert args[0] == "python", args
        args[0] = python
        args[args.index("--model") + 1] = str(model)
        args[args.index("--port") + 1] = str(port)
        at = args.index("--kv-transfer-config") + 1
        transfer = json.loads(args[at])
        assert (transfer["kv_connector"], transfer["kv_connector_module_path"]) == connector, transfer
        transfer["kv_connector_extra_config"]["shared_storage_path"] = str(storage)
        args[at] = json.dumps(transfer)
        speculative = json.loads(args[args.index("--speculative-config") + 1])
        assert speculative["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == (
            self.capture_layers
        ), "the block's --capture-layers are its launch's layer ids"
        return args


@dataclass
class ReadmeVLLM(VLLM):
    """The server deploy/vllm/README.md's "On a CPU host" block launches (ReadmeLaunch)."""

    def command(self) -> tuple[list[str], dict[str, str]]:
        launch = ReadmeLaunch.read()
        assert launch.capture_layers == self.layers, (launch.capture_layers, self.layers)
        args = launch.args(self.python, self.model_path, self.port, self.storage, self.connector)
        return args, {**launch.env, "HF_HUB_OFFLINE": "1", **self.env}


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


def items(
    n: int, seed: int, prefix: list[int] | None = None, lengths: tuple[int, int] = (5, 80)
) -> list[dict[str, Any]]:
    """`n` samples of random ids, `lengths` tokens long (after a shared `prefix`)."""
    rng = random.Random(seed)
    head = prefix or []
    return [
        {"id": f"s{i}", "input_ids": head + [rng.randrange(VOCAB) for _ in range(rng.randint(*lengths))]}
        for i in range(n)
    ]


def stored(svc: Service, job: dict[str, Any], layers: list[int], dtype: str) -> tuple[Path, Any]:
    """The job's folder and manifest, checked to be what vLLM gives: every sample proven by its ids, layer L
    before the final norm."""
    assert job["state"] == "succeeded", job
    folder = svc.output_root / job["id"]
    manifest = load_manifest(folder)
    assert manifest.layers == layers and manifest.dtype == dtype
    assert manifest.final_layer == "pre_norm" and manifest.post_norm_layers == []
    assert manifest.identity == "ids"
    return folder, manifest


def largest_difference(
    svc: Service,
    m: torch.nn.Module,
    job: dict[str, Any],
    samples: list[dict[str, Any]],
    layers: list[int],
    relative: bool = False,
) -> float:
    """Every stored tensor of a float32 job against the recomputation of its own ids: the largest difference,
    or with `relative`, the largest of each row's difference over that row's largest magnitude (a bound
    that does not depend on the model's scale)."""
    folder, manifest = stored(svc, job, layers, "float32")
    worst = 0.0
    for s in samples:
        got = read_sample(folder, manifest, s["id"])
        assert got["input_ids"].tolist() == s["input_ids"]
        for k, want in truth(m, s["input_ids"], layers).items():
            diff = (got[f"layer_{k}"] - want).abs()
            if relative:
                diff = diff.amax(dim=-1) / want.abs().amax(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
            worst = max(worst, diff.max().item())
    return worst


def norm_weight_sha256(model: Path) -> str:
    """The sha256 of the final norm's weight as the checkpoint stores it (what the manifest names)."""
    import hashlib

    weight = load_file(str(model / "model.safetensors"))["model.norm.weight"]
    return hashlib.sha256(weight.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def check_final_norm_by_hsx(
    svc: Service, post: dict[str, Any], pre: dict[str, Any], samples: list[dict[str, Any]], model: Path
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Two jobs of the same samples on one vLLM: `post` asked for L after the final norm, which hsx computed,
    `pre` for L as vLLM gives it. Both succeeded, the manifests say so; returns (id, post-norm L, pre-norm L)
    per sample, as stored."""
    assert post["state"] == pre["state"] == "succeeded", (post, pre)
    folders = [svc.output_root / job["id"] for job in (post, pre)]
    manifests = [load_manifest(folder) for folder in folders]
    after, before = manifests
    assert after.final_layer == "post_norm" and after.post_norm_layers == [NUM_LAYERS]
    assert before.final_layer == "pre_norm" and before.post_norm_layers == []
    assert after.final_norm is not None and before.final_norm is None
    assert after.final_norm["applied_by"] == "hsx" and after.final_norm["checkpoint"] == str(model)
    assert after.final_norm["tensor"] == "model.norm.weight"
    assert after.final_norm["sha256"] == norm_weight_sha256(model)
    assert "eagle3" in after.sets() and "eagle3_pre_norm" in before.sets()
    rows = []
    for s in samples:
        got = [read_sample(folder, manifest, s["id"]) for folder, manifest in zip(folders, manifests)]
        assert got[0]["input_ids"].tolist() == got[1]["input_ids"].tolist() == s["input_ids"]
        for k in after.layers or []:
            if k != NUM_LAYERS:
                assert torch.equal(got[0][f"layer_{k}"], got[1][f"layer_{k}"]), "only layer L differs"
        rows.append((s["id"], got[0][f"layer_{NUM_LAYERS}"], got[1][f"layer_{NUM_LAYERS}"]))
    return rows

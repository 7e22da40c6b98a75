"""The real parts a user runs, started for tests: a tiny checkpoint, the reference server, the service,
and the two side by side."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from hsx.states import TERMINAL_JOB_STATES
from tests.support.procs import Process, free_port, hsx_command

PLUGIN_SOURCE = Path(__file__).resolve().parents[2] / "deploy" / "sglang"
# Eight decoder layers make EAGLE-3's default capture [2, L//2, L-3, L] four distinct layers.
NUM_LAYERS = 8
VOCAB = 320
HIDDEN = 48


def make_checkpoint(path: Path, seed: int = 7, dtype: torch.dtype = torch.bfloat16) -> Path:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.to(dtype).save_pretrained(path)
    return path


class Recompute:
    """Hidden states computed in the test process with plain transformers: the ground truth."""

    def __init__(self, checkpoint: Path):
        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype="auto", local_files_only=True).eval()

    def __call__(self, ids: list[int]) -> tuple[torch.Tensor, ...]:
        with torch.inference_mode():
            out = self.model(torch.tensor([ids]), output_hidden_states=True)
        return tuple(h[0] for h in out.hidden_states)


@dataclass
class RefServer:
    url: str
    dump_root: Path
    proc: Process

    def stop(self) -> None:
        self.proc.stop()


def start_reference(
    tmp: Path,
    checkpoint: Path | None,
    *,
    dump_root: Path | None = None,
    port: int | None = None,
    extra: list[str] | None = None,
    ready_timeout: float = 90.0,
) -> RefServer:
    port = port or free_port()
    dump_root = dump_root or tmp / "dumps"
    args = hsx_command() + ["reference-server", "--dump-root", str(dump_root), "--port", str(port)]
    if checkpoint is not None:
        args += ["--model", str(checkpoint)]
    proc = Process(args + (extra or []), tmp / f"reference-{port}.log")
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(url + "/health", timeout=ready_timeout)
    return RefServer(url, dump_root, proc)


def start_stock_sglang(
    tmp: Path, checkpoint: Path, *, dump_root: Path | None = None, port: int | None = None, flags: list[str]
) -> RefServer:
    """The reference server as stock SGLang 0.5.23 launched with `flags`; with `dump_root`, the
    hsx-sglang plugin (imported from deploy/sglang) writes dumps there, as HSX_DUMP_ROOT tells it."""
    port = port or free_port()
    args = hsx_command() + ["reference-server", "--stock-sglang", "--model", str(checkpoint), "--port", str(port)]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(PLUGIN_SOURCE), os.environ.get("PYTHONPATH")]))}
    if dump_root is not None:
        env["HSX_DUMP_ROOT"] = str(dump_root)
    proc = Process(args + flags, tmp / f"stock-sglang-{port}.log", env=env)
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(url + "/health")
    return RefServer(url, dump_root, proc)


@dataclass
class Service:
    url: str
    output_root: Path
    input_root: Path
    database_url: str
    proc: Process
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=30))

    def post_job(self, body: dict) -> httpx.Response:
        return self.client.post(self.url + "/v1/jobs", json=body)

    def get(self, path: str, **kw) -> httpx.Response:
        return self.client.get(self.url + path, **kw)

    def wait_job(self, job_id: str, timeout: float = 180.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.get(f"/v1/jobs/{job_id}").json()
            if job["state"] in TERMINAL_JOB_STATES:
                return job
            time.sleep(0.2)
        raise TimeoutError(f"job {job_id} still {job['state']} after {timeout}s: {job}\n{self.proc.log()[-3000:]}")

    def stop(self) -> None:
        self.client.close()
        self.proc.stop()


def start_service(
    tmp: Path,
    database_url: str,
    *,
    backend_url: str = "http://127.0.0.1:9",
    dump_root: Path | None = None,
    extra: list[str] | None = None,
    wait: bool = True,
    port: int | None = None,
) -> Service:
    port = port or free_port()
    output_root, input_root = tmp / "output", tmp / "input"
    input_root.mkdir(parents=True, exist_ok=True)
    args = hsx_command() + [
        "serve",
        "--backend-url",
        backend_url,
        "--dump-root",
        str(dump_root or tmp / "dumps"),
        "--output-root",
        str(output_root),
        "--input-root",
        str(input_root),
        "--database-url",
        database_url,
        "--port",
        str(port),
        "--dump-wait-s",
        "10",
    ]
    proc = Process(args + (extra or []), tmp / f"service-{port}.log")
    url = f"http://127.0.0.1:{port}"
    if wait:
        proc.wait_http(url + "/healthz")
    return Service(url, output_root, input_root, database_url, proc)


def start_stack(tmp: Path, checkpoint: Path, extra: list[str] | None = None, reference_extra: list[str] | None = None):
    """Reference server and service (SQLite) started side by side; returns once the writer is ready.
    `extra` goes to the service's command line, `reference_extra` to the reference server's."""
    port, dump_root = free_port(), tmp / "dumps"
    svc = start_service(
        tmp,
        f"sqlite:///{tmp / 'hsx.db'}",
        backend_url=f"http://127.0.0.1:{port}",
        dump_root=dump_root,
        extra=extra,
        wait=False,
    )
    try:
        ref = start_reference(tmp, checkpoint, dump_root=dump_root, port=port, extra=reference_extra)
    except BaseException:
        svc.stop()
        raise
    try:
        svc.proc.wait_http(svc.url + "/healthz", ok=lambda r: r.json().get("status") == "ok")
    except BaseException:
        svc.stop()
        ref.stop()
        raise
    return svc, ref


def stop_stack(*parts) -> None:
    """Stop the service and the reference server side by side."""
    threads = [threading.Thread(target=part.stop) for part in parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

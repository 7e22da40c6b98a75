"""GPU benchmark: how long a real model's GPU waits on hsx.

    python -m benchmarks.bench_gpu          # Llama-3-8B's shape on CUDA (sized for under 8 minutes on one H200)
    python -m benchmarks.bench_gpu --smoke  # the same code path on the CPU with a tiny model (under a minute)

Builds a model of Llama-3-8B's shape (32 layers, hidden 4096, intermediate 14336, 32 heads, 8 KV
heads, vocabulary 128256) with random weights in bf16 from a transformers LlamaConfig (nothing is
downloaded) and saves it as a checkpoint (in /dev/shm when it has room). Then measures prefill
tokens/s (prompts of --tokens tokens, no decode, the captured layers EAGLE-3's 2, 16, 29, 32):

  model alone         ModelRunner.run in this process, one prompt after the other: the forward pass
                      and the captured layers' copy to host memory, nothing written
  server alone        `hsx reference-server --device cuda` in rid mode, --in-flight requests in flight,
                      each dump deleted by the client as soon as its reply comes: the model server as
                      it runs with nobody reading its dumps (the baseline hsx is measured against)
  service, clear-and-scan / rid mode
                      the same server (counter mode for clear-and-scan) with `hsx serve` reading its
                      dumps from /dev/shm and persisting them to shards on the local disk (SQLite)

and prints, for each, tokens/s, GB/s persisted, the fraction of the model alone's rate, and the
fraction of time the GPU waits on hsx: 1 - service tokens/s / server-alone tokens/s, next to the
target (rid mode keeps the GPU >= 90% as busy as without hsx). The last lines are a table ready for
docs/performance.md, with the date.

Without CUDA (and without --smoke) it prints why it is skipped and exits 0. --smoke runs every step
on the CPU with a tiny model and few short prompts, so the script keeps working while no GPU is at
hand (tests/acceptance/test_bench_gpu.py runs it).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import date, datetime, timezone
from pathlib import Path

import httpx
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks.report import Column, Report, Table, add_json_argument
from hsx.layers import eagle3_capture_layers
from hsx.reference.model import ModelRunner, embedded_config
from tests.support.stack import RefServer, start_reference, start_service

GiB = 1024**3
TARGET_BUSY = 0.90  # rid mode: the GPU at least this busy, against the server alone


@dataclass(frozen=True)
class Shape:
    name: str
    config: LlamaConfig
    device: str
    samples: int
    tokens: int
    command: str


def llama3_8b() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    )


def build_model(config: LlamaConfig, device: str) -> LlamaForCausalLM:
    """Random weights, made on the device in bf16 (an 8B model takes seconds there, minutes on a CPU)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(torch.bfloat16).eval()


def checkpoint_dir(work: Path, model: torch.nn.Module) -> Path:
    """/dev/shm when it has room for the checkpoint twice over (the dumps go there too), else `work`."""
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 2 * nbytes:
        return Path(tempfile.mkdtemp(prefix="hsx-bench-gpu-checkpoint-", dir=shm))
    return work / "checkpoint"


def prompts(n: int, tokens: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(tokens)] for _ in range(n)]


def model_alone(model: LlamaForCausalLM, layers: list[int], samples: list[list[int]]) -> float:
    """Seconds for the forward passes of `samples`, one after the other, as the server runs them."""
    runner = ModelRunner(model, "bench", layers)
    runner.run(samples[0], 0)  # kernels chosen, memory pools grown: not part of the rate
    start = time.perf_counter()
    for ids in samples:
        runner.run(ids, 0)
    return time.perf_counter() - start


def warm_up(ref: RefServer, ids: list[int]) -> None:
    """One prompt through a fresh server, its dump removed: kernels chosen and memory pools grown
    before anything is timed."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}}
    httpx.post(ref.url + "/generate", json=body, timeout=600).raise_for_status()
    for d in ref.dump_root.glob("req_*"):
        shutil.rmtree(d)


def server_alone(ref: RefServer, samples: list[list[int]], in_flight: int) -> float:
    """Seconds for the server to answer `samples`, `in_flight` at a time; nobody reads the dumps,
    each is deleted as soon as its reply comes (a dump root must not fill /dev/shm)."""
    with httpx.Client(timeout=600) as client:

        def one(k: int) -> None:
            rid = f"alone-{k}"
            body = {"input_ids": samples[k], "rid": rid, "sampling_params": {"max_new_tokens": 0}}
            client.post(ref.url + "/generate", json=body).raise_for_status()
            shutil.rmtree(ref.dump_root / f"req_{rid}")

        start = time.perf_counter()
        with ThreadPoolExecutor(in_flight) as pool:
            list(pool.map(one, range(len(samples))))
        return time.perf_counter() - start


def service_run(work: Path, ref: RefServer, samples: list[list[int]], in_flight: int, name: str) -> float:
    """Seconds from a job's submission to its end (its own finished_at), `hsx serve` persisting `samples`."""
    folder = work / name
    svc = start_service(
        folder,
        f"sqlite:///{folder / 'hsx.db'}",
        backend_url=ref.url,
        dump_root=ref.dump_root,
        extra=["--max-in-flight", str(in_flight), "--log-level", "warning"],
    )
    try:
        body = "".join(json.dumps({"id": f"{name}-{k}", "input_ids": ids}) + "\n" for k, ids in enumerate(samples))
        started = datetime.now(timezone.utc)
        job = svc.client.post(
            svc.url + "/v1/jobs", content=body.encode(), headers={"content-type": "application/x-ndjson"}
        ).json()
        state = svc.wait_job(job["id"], timeout=1800)
    finally:
        svc.stop()
    if state["state"] != "succeeded":
        raise RuntimeError(f"{name}: job ended {state['state']}: {state}\n{svc.proc.log()[-3000:]}")
    shutil.rmtree(folder)
    return (datetime.fromisoformat(state["finished_at"]) - started).total_seconds()


def run(shape: Shape, args: argparse.Namespace, work: Path) -> list[dict]:
    config = shape.config
    layers = eagle3_capture_layers(config.num_hidden_layers)
    samples = prompts(args.samples or shape.samples, args.tokens or shape.tokens, config.vocab_size, seed=0)
    tokens = sum(len(s) for s in samples)
    persisted = tokens * len(layers) * config.hidden_size * 2
    print(
        f"{shape.name}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, bf16, on {shape.device}; "
        f"{len(samples)} prompts of {len(samples[0])} tokens, layers {layers} captured "
        f"({persisted / len(samples) / 2**20:.1f} MiB per dump)",
        flush=True,
    )
    started = time.perf_counter()
    model = build_model(config, shape.device)
    ckpt = checkpoint_dir(work, model)
    model.save_pretrained(ckpt)
    print(f"checkpoint: random weights saved to {ckpt} in {time.perf_counter() - started:.0f} s", flush=True)
    try:
        seconds = {"model alone": model_alone(model, layers, samples)}
        del model
        gc.collect()
        if shape.device.startswith("cuda"):
            torch.cuda.empty_cache()
        server_args = ["--dtype", "bfloat16", "--device", shape.device, "--skip-server-warmup"]
        servers = (
            ("rid", {"server alone": None, "service, rid mode": "rid"}),
            ("counter", {"service, clear-and-scan": "serial"}),
        )
        for mode, runs in servers:
            shm = Path(tempfile.mkdtemp(prefix="hsx-bench-gpu-", dir="/dev/shm"))
            ref = start_reference(
                work,
                ckpt,
                dump_root=shm / "dumps",
                extra=[*server_args, "--name-by", mode, "--layers", ",".join(map(str, layers))],
                ready_timeout=600,
            )
            try:
                warm_up(ref, samples[0])
                for label, name in runs.items():
                    if name is None:
                        seconds[label] = server_alone(ref, samples, args.in_flight)
                    else:
                        seconds[label] = service_run(work, ref, samples, args.in_flight, name)
                    print(f"{label}: {seconds[label]:.1f} s", flush=True)
            finally:
                ref.stop()
                shutil.rmtree(shm, ignore_errors=True)
    finally:
        if ckpt.is_relative_to("/dev/shm"):
            shutil.rmtree(ckpt, ignore_errors=True)
    alone, server = tokens / seconds["model alone"], tokens / seconds["server alone"]
    rows = []
    for label in ("model alone", "server alone", "service, clear-and-scan", "service, rid mode"):
        rate = tokens / seconds[label]
        service = label.startswith("service")
        rows.append(
            {
                "run": label,
                "tokens_s": rate,
                "samples_s": len(samples) / seconds[label],
                "gb_s": persisted / seconds[label] / 1e9 if service else None,
                "of_model": rate / alone,
                "of_server": rate / server,
                "gpu_waits": 1 - rate / server if service else None,
            }
        )
    return rows


def print_report(shape: Shape, rows: list[dict], in_flight: int, report: Report) -> None:
    device = torch.cuda.get_device_name() if shape.device.startswith("cuda") else "CPU"
    table = report.table(
        "runs",
        Column("run", "run", left=True),
        Column("tokens_s", "tokens/s", ".0f"),
        Column("samples_s", "samples/s", ".2f"),
        Column("gb_s", "GB/s", ".3g"),
        Column("of_model", "of model", ".0%"),
        Column("of_server", "of server", ".0%"),
        Column("gpu_waits", "GPU waits", ".0%"),
    )
    for r in rows:
        table.add(**r)
    rid = next(r for r in rows if r["run"] == "service, rid mode")
    verdict = "met" if rid["of_server"] >= TARGET_BUSY else "NOT met"
    print(
        f"target: rid mode keeps the GPU >= {TARGET_BUSY:.0%} as busy as the server alone: "
        f"{rid['of_server']:.0%}, {verdict}"
    )
    report.figure("device", device)
    print()
    print(
        f"{shape.name} on {device}, measured {date.today().isoformat()} ({in_flight} requests in flight; "
        f"`{shape.command}`):"
    )
    print()
    # the same rows, as docs/performance.md shows them
    page = Table(
        "page",
        (
            Column("run", "run"),
            Column("tokens_s", "prefill tokens/s", ".0f"),
            Column("gb_s", "GB/s persisted", ".3g"),
            Column("of_model", "of the model alone", ".0%"),
            Column("gpu_waits", "GPU waits on hsx", ".0%"),
        ),
        markdown=True,
    )
    print(page.header())
    for r in rows:
        print(page.line(r))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: the same steps, quickly")
    parser.add_argument("--samples", type=int, default=None, help="prompts per run (default: 160; smoke: 6)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per prompt (default: 2048; smoke: 64)")
    parser.add_argument("--in-flight", type=int, default=8, help="requests in flight (default: 8)")
    parser.add_argument("--output-dir", default=".", help="a folder on the disk the shards go to (default: here)")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        shape = Shape("tiny Llama (smoke)", embedded_config(), "cpu", 6, 64, "python -m benchmarks.bench_gpu --smoke")
    elif not torch.cuda.is_available():
        print("skipped: CUDA is not available (torch.cuda.is_available() is False); --smoke runs on the CPU")
        return 0
    else:
        shape = Shape(
            "Llama-3-8B shape, random weights", llama3_8b(), "cuda", 160, 2048, "python -m benchmarks.bench_gpu"
        )
    with tempfile.TemporaryDirectory(prefix="hsx-bench-gpu-", dir=args.output_dir) as tmp:
        rows = run(shape, args, Path(tmp))
    report = Report("bench_gpu", args)
    print_report(shape, rows, args.in_flight, report)
    report.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`hsx demo`: the embedded default end to end on this machine, in one command.

Starts the reference model server (tiny built-in model) and the service (SQLite) as
subprocesses on loopback, submits a small job, shows its progress, and prints where the
manifest is.
"""

from __future__ import annotations

import argparse
import hashlib
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from hsx.cli.client.common import Progress
from hsx.cli.extras import require
from hsx.sdk import HsxClient
from hsx.states import JobState

NAME = "demo"
EXTRA = "reference"  # for the reference server it starts
HELP = "run a small job end to end on this machine (reference server + service)"
DESCRIPTION = (
    "Run a small extraction job end to end on this machine: reference model server (embedded tiny "
    "model) + service + SQLite, all on loopback. Prints progress and the manifest path."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workdir", default="hsx-demo", help="folder for the database, dumps, logs and output (default: %(default)s)"
    )
    parser.add_argument("--samples", type=int, default=24, help="number of samples (default: %(default)s)")
    parser.add_argument("--min-tokens", type=int, default=16, help="shortest sample (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=256, help="longest sample (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for the samples (default: %(default)s)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "hsx.cli", *args],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"hsx demo: a process exited early; see {log}:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"hsx demo: {url} did not answer within {timeout}s; see {log}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(args: argparse.Namespace) -> int:
    require(EXTRA)
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    ref_port, svc_port = _free_port(), _free_port()
    dump_root = work / "dumps"
    print(f"hsx demo in {work}")
    ref_log, svc_log = work / "reference-server.log", work / "service.log"
    ref = _start(["reference-server", "--dump-root", str(dump_root), "--port", str(ref_port)], ref_log)
    svc = _start(
        [
            "serve",
            "--backend-url",
            f"http://127.0.0.1:{ref_port}",
            "--dump-root",
            str(dump_root),
            "--output-root",
            str(work / "output"),
            "--input-root",
            str(work / "input"),
            "--database-url",
            f"sqlite:///{work / 'hsx.db'}",
            "--port",
            str(svc_port),
        ],
        svc_log,
    )
    try:
        _wait_ready(f"http://127.0.0.1:{ref_port}/health", ref, ref_log)
        print(f"  reference model server ready on 127.0.0.1:{ref_port} (log: {ref_log})")
        _wait_ready(f"http://127.0.0.1:{svc_port}/healthz", svc, svc_log)
        print(f"  service ready on http://127.0.0.1:{svc_port} (log: {svc_log})")
        vocab = httpx.get(f"http://127.0.0.1:{ref_port}/get_model_info").json()["vocab_size"]
        rng = random.Random(args.seed)
        samples = [
            {
                "id": f"demo-{i}",
                "input_ids": [rng.randrange(vocab) for _ in range(rng.randint(args.min_tokens, args.max_tokens))],
            }
            for i in range(args.samples)
        ]
        with HsxClient(f"http://127.0.0.1:{svc_port}") as client:
            job = client.create_job(samples=samples, name="demo")
            print(f"  submitted {job.id}: {job.counts.total} samples, {job.tokens.total} tokens")
            progress = Progress(indent="  ")
            try:
                job = client.wait(job, timeout=600, poll_s=0.3, max_poll_s=1.0, on_progress=progress)
            finally:
                progress.close()
            manifest = client.manifest(job)
        job_dir = work / "output" / job.id
        for shard in manifest.shards:
            digest = hashlib.sha256((job_dir / shard.name).read_bytes()).hexdigest()
            status = "sha256 ok" if digest == shard.sha256 else "SHA256 MISMATCH"
            print(
                f"  {shard.name}: {shard.num_samples} samples, {shard.num_tokens} tokens, {shard.bytes} bytes, {status}"
            )
        print(f"  job {job.state}: layers {manifest.layers}, hidden {manifest.hidden_size}, {manifest.dtype}")
        print(f"manifest: {job_dir / 'manifest.json'}")
        return 0 if job.state == JobState.SUCCEEDED else 1
    finally:
        _stop(svc)
        _stop(ref)

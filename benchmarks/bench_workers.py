"""Workers benchmark: does throughput grow with workers on one Postgres queue?

    python -m benchmarks.bench_workers                             # 1 worker, then 3; 120 samples
    python -m benchmarks.bench_workers --workers 1 2 3 --samples 240 --prefill-us-per-token 4000

For each worker count N: N synthetic reference servers (each a model server of its own, prefill time
simulated at --prefill-us-per-token, so the model is the bottleneck as on a real node), N `hsx worker`s
beside them and one API (`hsx serve --no-writer`), all on a fresh database of the Postgres server at
--pg-admin. A fixed job (--samples of --tokens tokens) is timed from creation to success. Prints the
seconds, samples/s and the speedup over one worker.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import psycopg

from tests.support.procs import Process, free_port, hsx_command

VOCAB = 1000


def run(n: int, args: argparse.Namespace, tmp: Path, database_url: str) -> float:
    parts: list[Process] = []
    try:
        api_port = free_port()
        api = f"http://127.0.0.1:{api_port}"
        parts.append(
            Process(
                hsx_command()
                + ["serve", "--no-writer", "--database-url", database_url, "--output-root", str(tmp / "out")]
                + ["--port", str(api_port), "--input-root", str(tmp)],
                tmp / "api.log",
            )
        )
        parts[-1].wait_http(api + "/healthz")
        for i in range(n):
            port = free_port()
            dumps = tmp / f"w{i}" / "dumps"
            server = Process(
                hsx_command()
                + ["reference-server", "--synthetic", "--hidden-size", "256", "--num-layers", "8"]
                + ["--vocab-size", str(VOCAB), "--name-by", "rid", "--dump-root", str(dumps), "--port", str(port)]
                + ["--prefill-us-per-token", str(args.prefill_us_per_token)],
                tmp / f"server{i}.log",
            )
            parts.append(server)
            server.wait_http(f"http://127.0.0.1:{port}/health")
            parts.append(
                Process(
                    hsx_command()
                    + ["worker", "--backend-url", f"http://127.0.0.1:{port}", "--dump-root", str(dumps)]
                    + ["--output-root", str(tmp / "out"), "--database-url", database_url],
                    tmp / f"worker{i}.log",
                )
            )
        deadline = time.monotonic() + 120
        while sum(w["state"] == "ready" for w in httpx.get(api + "/v1/workers").json()["data"]) < n:
            if time.monotonic() > deadline:
                raise TimeoutError("workers not ready")
            time.sleep(0.2)
        rng = random.Random(1)
        samples = [
            {"id": f"s{i}", "input_ids": [rng.randrange(VOCAB) for _ in range(args.tokens)]}
            for i in range(args.samples)
        ]
        started = time.monotonic()
        job_id = httpx.post(api + "/v1/jobs", json={"samples": samples}, timeout=60).json()["id"]
        while (state := httpx.get(f"{api}/v1/jobs/{job_id}").json()["state"]) not in ("succeeded", "partial", "failed"):
            time.sleep(0.1)
        elapsed = time.monotonic() - started
        if state != "succeeded":
            raise RuntimeError(f"job {job_id} {state}")
        return elapsed
    finally:
        for p in reversed(parts):
            p.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--samples", type=int, default=120)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prefill-us-per-token", type=float, default=4000.0)
    parser.add_argument("--pg-admin", default="postgresql://postgres@127.0.0.1:5432/test")
    args = parser.parse_args(argv)
    results: dict[int, float] = {}
    for n in args.workers:
        name = f"hsx_bench_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(args.pg_admin, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        url = args.pg_admin.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1) + f"/{name}"
        try:
            with tempfile.TemporaryDirectory(prefix="hsx-workers-") as tmp:
                results[n] = run(n, args, Path(tmp), url)
        finally:
            with psycopg.connect(args.pg_admin, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        first = args.workers[0]
        print(
            f"{n} worker(s): {results[n]:.1f} s, {args.samples / results[n]:.2f} samples/s, "
            f"{results[first] / results[n]:.2f}x {first} worker(s)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

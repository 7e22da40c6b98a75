"""What each dump's proof of identity costs per sample, in clear-and-scan (one request at a time).

    python -m benchmarks.bench_identity                 # 200 samples of 512 tokens per row
    python -m benchmarks.bench_identity --samples 500 --tokens 2048

Each row runs one job against a synthetic reference server (counter-named dumps) and an `hsx serve`
on SQLite: dumps carrying ids (taken as soon as they complete), and dumps carrying neither ids nor rid
(`--anonymous-dumps`, taken once the root stood still for --dump-settle-s) at the default settle window
and at 0. It prints the job's wall time per sample; the difference between rows is what the proof costs.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from benchmarks.report import Column, Report, add_json_argument
from tests.support.procs import Process, free_port, synthetic_server_args
from tests.support.stack import start_service

HIDDEN, NUM_LAYERS, VOCAB = 1024, 8, 32000


def run(dumps: str, settle_s: float, args: argparse.Namespace) -> float:
    """Seconds per sample of one job."""
    with tempfile.TemporaryDirectory(prefix="hsx-identity-") as tmp_name:
        tmp = Path(tmp_name)
        port = free_port()
        extra = ["--skip-server-warmup"] + (["--anonymous-dumps"] if dumps == "count" else [])
        server = Process(
            synthetic_server_args(
                hidden=HIDDEN, num_layers=NUM_LAYERS, vocab=VOCAB, dump_root=tmp / "dumps", port=port, extra=extra
            ),
            tmp / "server.log",
        )
        url = f"http://127.0.0.1:{port}"
        server.wait_http(url + "/health")
        svc = start_service(
            tmp, f"sqlite:///{tmp / 'hsx.db'}", backend_url=url, extra=["--dump-settle-s", str(settle_s)]
        )
        try:
            rng = random.Random(0)
            items = [
                {"id": f"s{i}", "input_ids": [rng.randrange(VOCAB) for _ in range(args.tokens)]}
                for i in range(args.samples)
            ]
            started = time.perf_counter()
            job = svc.wait_job(svc.post_job({"samples": items}).json()["id"], timeout=3600)
            took = time.perf_counter() - started
            if job["state"] != "succeeded":
                raise SystemExit(f"job {job['id']} ended {job['state']}")
            return took / args.samples
        finally:
            svc.stop()
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--settle-s", type=float, default=0.05, help="the settle window of the count row")
    add_json_argument(parser)
    args = parser.parse_args()
    report = Report("bench_identity", args)
    print(f"{args.samples} samples of {args.tokens} tokens, clear-and-scan, synthetic server, SQLite")
    table = report.table(
        "runs",
        Column("dumps_carry", "dumps carry", left=True),
        Column("settle_s", "settle s", ".3f"),
        Column("ms_per_sample", "ms / sample", ".1f"),
    )
    rows = [("ids (identity: ids)", "ids", args.settle_s), ("nothing (identity: count)", "count", args.settle_s)]
    rows.append(("nothing (identity: count)", "count", 0.0))
    for label, dumps, settle in rows:
        table.add(dumps_carry=label, settle_s=settle, ms_per_sample=1000 * run(dumps, settle, args))
    report.write()


if __name__ == "__main__":
    main()

"""Scale benchmark: a job of a million samples.

    python -m benchmarks.bench_scale                     # 1,000,000 samples, SQLite
    python -m benchmarks.bench_scale --samples 200000 --database-url postgresql://postgres@127.0.0.1/test

Streams the job as JSONL (application/x-ndjson) into a service whose writer extracts from a small
synthetic reference server, then, while it runs, times GET /v1/jobs/{id} and a page of samples,
cancels it (the request answers with the job cancelling; benchmarks/bench_cancel.py times the rest), and
reports the service's peak RSS. Prints: creation time, GET latency p50/p99, page latency, the cancel
request's time, RSS.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from hsx.states import JobState
from tests.support.procs import Process, free_port, hsx_command, proc_cpu_and_rss

MiB = 1024 * 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--tokens", type=int, default=16, help="tokens per sample")
    parser.add_argument("--database-url", default=None, help="default: a SQLite file in a temporary folder")
    parser.add_argument("--requests", type=int, default=500, help="GETs timed while the job runs")
    args = parser.parse_args(argv)
    with (
        tempfile.TemporaryDirectory(prefix="hsx-scale-") as tmp,
        tempfile.TemporaryDirectory(prefix="hsx-scale-", dir="/dev/shm") as shm,
    ):
        work = Path(tmp)
        ref_port, svc_port = free_port(), free_port()
        ref = Process(
            hsx_command()
            + [
                "reference-server",
                "--synthetic",
                "--hidden-size",
                "64",
                "--num-layers",
                "8",
                "--vocab-size",
                "32000",
                "--dump-root",
                f"{shm}/dumps",
                "--port",
                str(ref_port),
            ],
            work / "reference.log",
        )
        ref.wait_http(f"http://127.0.0.1:{ref_port}/health")
        url = args.database_url or f"sqlite:///{work / 'scale.db'}"
        svc = Process(
            hsx_command()
            + [
                "serve",
                "--backend-url",
                f"http://127.0.0.1:{ref_port}",
                "--dump-root",
                f"{shm}/dumps",
                "--output-root",
                str(work / "out"),
                "--input-root",
                str(work),
                "--database-url",
                url,
                "--port",
                str(svc_port),
                "--log-level",
                "warning",
            ],
            work / "service.log",
        )
        base = f"http://127.0.0.1:{svc_port}"
        svc.wait_http(base + "/healthz")
        rng = random.Random(0)
        row = [rng.randrange(32000) for _ in range(args.tokens)]

        def body():
            for i in range(args.samples):
                yield (json.dumps({"id": f"s{i}", "input_ids": row}) + "\n").encode()

        with httpx.Client(timeout=3600) as c:
            start = time.perf_counter()
            resp = c.post(base + "/v1/jobs", content=body(), headers={"content-type": "application/x-ndjson"})
            created = time.perf_counter() - start
            job = resp.json()
            assert resp.status_code == 202, resp.text
            times, pages = [], []
            for i in range(args.requests):
                t = time.perf_counter()
                state = c.get(f"{base}/v1/jobs/{job['id']}").json()
                times.append(time.perf_counter() - t)
                if i % 10 == 0:
                    t = time.perf_counter()
                    c.get(f"{base}/v1/jobs/{job['id']}/samples", params={"limit": 100, "after": f"s{i * 1000}"})
                    pages.append(time.perf_counter() - t)
            done = state["counts"]["succeeded"] + state["counts"]["staged"]
            t = time.perf_counter()
            cancel = c.post(f"{base}/v1/jobs/{job['id']}/cancel")
            cancel_s = time.perf_counter() - t
            assert cancel.status_code == 200, cancel.text
            assert cancel.json()["state"] in (JobState.CANCELLING, JobState.CANCELLED), cancel.text
            queued = cancel.json()["counts"]["queued"]
        _, rss = proc_cpu_and_rss(svc.proc.pid)
        svc.stop()
        ref.stop()
    times.sort()
    print(f"{args.samples:,} samples of {args.tokens} tokens on {url.split(':')[0]}")
    print(f"  create (streamed NDJSON):   {created:.1f} s ({args.samples / created:,.0f} samples/s)")
    print(
        f"  GET /v1/jobs/{{id}} running: p50 {statistics.median(times) * 1000:.1f} ms, "
        f"p99 {times[int(len(times) * 0.99) - 1] * 1000:.1f} ms over {len(times)} requests "
        f"({done:,} samples extracted meanwhile)"
    )
    print(
        f"  GET .../samples page of 100: p50 {statistics.median(pages) * 1000:.1f} ms, max {max(pages) * 1000:.1f} ms"
    )
    print(f"  POST .../cancel:            {cancel_s * 1000:.0f} ms ({queued:,} queued samples left to the background)")
    print(f"  service peak RSS:           {rss / MiB:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())

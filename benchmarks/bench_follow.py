"""Training while a job extracts: how soon a trainer sees a recorded shard, how fast it reads, and how much
disk a job holds when its trainers keep up.

    python -m benchmarks.bench_follow
    python -m benchmarks.bench_follow --samples 24 --tokens 256     # smaller, quicker

Three parts, one service and one synthetic reference server (hidden --hidden, EAGLE-3's four layers of a
32-layer model, bfloat16) on this machine:

  latency    a follower (HiddenStateStream over HTTP, started before the job's first shard) reads a job whose
             server takes --prefill-us-per-token: for each shard, the time from its recording (its
             created_at in the database) to the follower's first item from it; p50 and p99. The service
             runs with --shard-max-wait-s; the target is p50 under that plus one second.
  read rate  finished jobs stored raw, lossless and fp8, each read whole by HiddenStateStream from the job's
             folder (local) and over HTTP (downloaded into a cache, sha256-checked, deleted once read):
             tokens per CPU second of the reading process (per core), and HTTP's ratio to local (target
             >= 0.8). The service shares the machine: its CPU is not counted.
  disk       the same job with retention acked, max_unread_bytes of --unread-shards shards and one slow
             consumer, against retention keep: the largest size of the job's shards on disk while it ran.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.report import Column, Report, add_json_argument
from hsx.sdk import HsxClient
from hsx.training import HiddenStateStream
from tests.support.procs import start_synthetic
from tests.support.stack import Service, start_service

LAYERS_L = 32
MiB = 1024 * 1024


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path, prefill_us: float):
        self.args, self.work = args, work
        self.server, url = start_synthetic(
            work,
            hidden=args.hidden,
            num_layers=LAYERS_L,
            vocab=32000,
            dump_root=work / "dumps",
            extra=["--prefill-us-per-token", str(prefill_us), "--skip-server-warmup"],
        )
        self.sample_bytes = args.tokens * (4 * args.hidden * 2 + 16)
        self.shard_bytes = args.samples_per_shard * self.sample_bytes
        extra = ["--shard-max-bytes", str(self.shard_bytes), "--shard-max-wait-s", str(args.shard_max_wait_s)]
        self.service: Service = start_service(
            work, f"sqlite:///{work / 'hsx.db'}", backend_url=url, dump_root=work / "dumps", extra=extra
        )
        self.hsx = HsxClient(self.service.url, timeout=600)

    def job(self, name: str, **options) -> str:
        rng = random.Random(name)
        samples = [
            {"id": f"s{i:05d}", "input_ids": [rng.randrange(1, 32000) for _ in range(self.args.tokens)]}
            for i in range(self.args.samples)
        ]
        return self.hsx.create_job(samples, name=name, options=options).id

    def stop(self) -> None:
        self.hsx.close()
        self.service.stop()
        self.server.stop()


def latency(bench: Bench, report: Report) -> None:
    """Seconds from each shard's recording to the follower's first item from it."""
    job = bench.job("latency")
    stream = HiddenStateStream(bench.hsx, job, cache_dir=bench.work / "cache-latency", wait_s=5)
    arrived = {item["id"]: time.time() for item in stream}
    delays = sorted(
        min(arrived[s.id] for s in shard.samples) - shard.created_at.timestamp()
        for shard in bench.hsx.list_shards(job).data
    )
    table = report.table(
        "latency",
        Column("shards", "shards"),
        Column("p50_s", "commit to trainer p50 s", ".3f"),
        Column("p99_s", "p99 s", ".3f"),
        Column("target_s", "target p50 s", ".1f"),
    )
    table.add(
        shards=len(delays),
        p50_s=statistics.median(delays),
        p99_s=delays[min(len(delays) - 1, round(0.99 * (len(delays) - 1)))],
        target_s=bench.args.shard_max_wait_s + 1,
        delays=delays,
    )


def read_rates(bench: Bench, report: Report) -> None:
    table = report.table(
        "read_rate",
        Column("encoding", "encoding", left=True),
        Column("local_tokens_s", "local tokens/s per core", ",.0f"),
        Column("http_tokens_s", "HTTP tokens/s per core", ",.0f"),
        Column("http_x_local", "HTTP x local", ".2f"),
    )
    for enc in ("raw", "lossless", "fp8"):
        job = bench.job(f"rate-{enc}", encoding=enc)
        bench.hsx.wait(job, poll_s=0.2, max_poll_s=0.5)
        tokens = bench.args.samples * bench.args.tokens
        local = _cpu(lambda j=job: _drain(HiddenStateStream(bench.service.output_root / j)))
        http = _cpu(lambda j=job: _drain(HiddenStateStream(bench.hsx, j, cache_dir=bench.work / "cache-rate")))
        table.add(
            encoding=enc,
            local_tokens_s=tokens / local,
            http_tokens_s=tokens / http,
            http_x_local=local / http,
        )


def _drain(stream: HiddenStateStream) -> int:
    return sum(1 for _ in stream)


def _cpu(fn) -> float:
    fn()  # warm: the first read pays for what a process does once (and fills the page cache)
    started = time.process_time()
    fn()
    return time.process_time() - started


def disk(bench: Bench, report: Report) -> None:
    table = report.table(
        "disk",
        Column("retention", "retention", left=True),
        Column("high_water_mib", "largest on disk MiB", ",.1f"),
        Column("bound_mib", "limit + 2 shards MiB", ",.1f"),
        Column("job_mib", "the job MiB", ",.1f"),
    )
    limit = bench.args.unread_shards * bench.shard_bytes
    for retention in ("keep", "acked"):
        options = {"consumers": ["slow"], "retention": retention}
        if retention == "acked":
            options["max_unread_bytes"] = limit
        job = bench.job(f"disk-{retention}", **options)
        with HighWater(bench.service.output_root / job) as high:
            stream = HiddenStateStream(bench.hsx, job, consumer="slow", cache_dir=bench.work / "cache-disk", wait_s=5)
            for n, _ in enumerate(stream, start=1):
                time.sleep(bench.args.consumer_sleep)
                if n % bench.args.samples_per_shard == 0:
                    stream.ack()
            stream.ack()
        job_bytes = sum(s.bytes for s in bench.hsx.list_shards(job).data)
        table.add(
            retention=retention,
            high_water_mib=high.bytes / MiB,
            bound_mib=(limit + 2 * bench.shard_bytes) / MiB if retention == "acked" else None,
            job_mib=job_bytes / MiB,
        )


class HighWater:
    """The largest size a job's shards took on disk together while the block ran, sampled every 20 ms."""

    def __init__(self, folder: Path):
        self.folder, self.bytes = folder, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch)

    def __enter__(self) -> HighWater:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.is_set():
            size = 0
            for p in self.folder.glob("shard-*"):
                with contextlib.suppress(FileNotFoundError):  # deleted by retention since the listing
                    size += p.stat().st_size
            self.bytes = max(self.bytes, size)
            time.sleep(0.02)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=48, help="samples per job (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=512, help="tokens per sample (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size (default: %(default)s)")
    parser.add_argument("--samples-per-shard", type=int, default=4, help="a shard's samples (default: %(default)s)")
    parser.add_argument("--shard-max-wait-s", type=float, default=2.0, help="the service's (default: %(default)s)")
    parser.add_argument(
        "--prefill-us-per-token", type=float, default=200.0, help="the server's prefill (default: %(default)s)"
    )
    parser.add_argument("--unread-shards", type=int, default=3, help="max_unread_bytes in shards (default: 3)")
    parser.add_argument(
        "--consumer-sleep", type=float, default=0.05, help="the slow consumer's seconds per item (default: 0.05)"
    )
    parser.add_argument("--output-dir", default=".", help="a folder on the disk the jobs write to (default: here)")
    parser.add_argument("--only", choices=["all", "latency", "rate", "disk"], default="all")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    report = Report("bench_follow", args)
    print(
        f"{datetime.now(timezone.utc):%Y-%m-%d}: {args.samples} samples of {args.tokens} tokens a job, hidden "
        f"{args.hidden} x 4 layers bfloat16 ({args.tokens * 4 * args.hidden * 2 / MiB:.1f} MiB a sample), "
        f"{args.samples_per_shard} a shard, --shard-max-wait-s {args.shard_max_wait_s}"
    )
    with tempfile.TemporaryDirectory(prefix="hsx-bench-follow-", dir=args.output_dir) as tmp:
        bench = Bench(args, Path(tmp), args.prefill_us_per_token)
        try:
            if args.only in ("all", "latency"):
                latency(bench, report)
            if args.only in ("all", "rate"):
                read_rates(bench, report)
            if args.only in ("all", "disk"):
                disk(bench, report)
        finally:
            bench.stop()
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

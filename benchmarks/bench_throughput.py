"""Throughput benchmark: the service against the first pipeline's bare loop, side by side, and
where the service's time goes.

    python -m benchmarks.bench_throughput                  # the defaults below
    python -m benchmarks.bench_throughput --samples 60 --tokens 2000 --hidden 4096 --layers 4
    python -m benchmarks.bench_throughput --only writer --writer-gb 4   # the shard writer alone, quickly

Runs, in one process tree on this machine, with a synthetic reference server (no model compute,
tensors of a realistic shape written to /dev/shm):
  disk      the output disk's sequential write rate (8 MiB writes, then fsync; as many bytes as a run;
            the better of buffered and direct writes)
  minimum   the bare minimum of persisting a run's bytes: one thread hashes them once (sha256) and
            writes them with O_DIRECT straight from a mapping of a file in /dev/shm; its CPU seconds
            per GB are what every row's CPU per GB is compared with ("x min"). Measured before and
            after every run, and each row compared with the mean of the two around it: on a virtual
            machine the same work's CPU cost moves by a fifth from minute to minute
  bare      the first pipeline's shape: one sample at a time, clear -> POST -> scan -> load -> save,
            no database, no API. Timed to its last save (files possibly still in the page cache) and,
            from the same run, until its files are on disk (fsync of each after the loop): the ratios
            ("x bare") are against the latter, because a real job (terabytes) cannot live in the page
            cache, so over a whole job the loop runs at the disk's pace. Also the loop made as durable
            as the service, each file fsynced as it is saved.
  serial    the service in clear-and-scan mode (SQLite)
  rid       the service in rid mode with requests in flight, against a server that batches
each with an instant server and with a simulated prefill as long as, and four times as long as,
what persisting costs the first pipeline (the bare loop's time per sample with an instant server).
Prints samples/s, tokens/s, GB/s persisted, CPU seconds per sample and per GB (the service's summed
over its whole process tree, while a client waits on the job as `hsx status --watch` does; the bare
loop's is this process's) and peak RSS.

Then the shard writer alone: write_shard, as the service's flushers call it, writing --writer-gb of
shards (the service's default shard size) from --writer-staged dumps staged in /dev/shm to the output
disk, with one flusher and with two threads each writing its own shards; GB/s and CPU seconds per GB
of each, against the disk's O_DIRECT rate measured just before and after, and the bare minimum on
those bytes. `--only writer` runs this part alone.

A virtual disk's rate drifts from minute to minute, so the disk is measured again after every
scenario (the table uses the median, the range is printed), every run starts after a sync so that
none pays for the writeback of the one before it, and `--repeat N` runs every row N times and
reports the run with the median rate. Every run starts warm: one sample goes through the loop or the
service first, unmeasured, so that what a process does once is not counted against a few samples.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from functools import partial
from pathlib import Path

import httpx
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from benchmarks.report import Column, Report, add_json_argument
from hsx.backends.dumps import load_staged
from hsx.config import Settings
from hsx.reference.dumper import Dumper
from hsx.sdk import HsxClient
from hsx.storage.atomic import fsync_path
from hsx.storage.shards import ShardSample, shard_name, write_shard
from tests.support.procs import Process, free_port, hsx_command, proc_cpu_and_rss, proc_tree_cpu

MiB = 1024 * 1024


def disk_write_rate(folder: Path, total_bytes: int) -> float:
    """Bytes per second of sequential 8 MiB writes followed by fsync, as many bytes as one run
    persists (a virtual disk often takes a short burst faster than a long write): the better of
    writes through the page cache and direct writes (O_DIRECT, as the service writes shards), so
    the disk's rate is what the device can do, whichever way reaches it."""
    return max(disk_write_rates(folder, total_bytes))


def disk_write_rates(folder: Path, total_bytes: int) -> tuple[float, float]:
    """disk_write_rate's two measurements: (through the page cache, O_DIRECT), bytes per second."""
    path = folder / "disk-rate.tmp"
    block = mmap.mmap(-1, 8 * MiB)  # page-aligned, as O_DIRECT needs
    block.write(os.urandom(8 * MiB))
    blocks = max(1, -(-total_bytes // len(block)))
    rates = []
    for direct in (0, getattr(os, "O_DIRECT", 0)):
        os.sync()
        start = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o644)
        try:
            for _ in range(blocks):
                os.write(fd, block)
            os.fsync(fd)
        finally:
            os.close(fd)
        rates.append(blocks * len(block) / (time.perf_counter() - start))
        path.unlink()
    return rates[0], rates[1]


def minimum_cost(shm: Path, folder: Path, total_bytes: int) -> float:
    """What persisting `total_bytes` cannot cost less than: one thread reads them from a file in
    /dev/shm (through a mapping: no copy of its own), hashes them once (sha256) and writes
    them with O_DIRECT straight from the mapping to a file on the output disk, then fsyncs. Returns
    that thread's CPU seconds per GB."""
    src, dst = shm / "minimum-src.tmp", folder / "minimum-dst.tmp"
    src.write_bytes(os.urandom(64 * MiB))
    os.sync()
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
    sha, written = hashlib.sha256(), 0
    cpu0 = time.thread_time()
    try:
        while written < total_bytes:
            # mapped afresh each pass, as every dump is a file of its own: its pages are faulted in again
            with open(src, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm, memoryview(mm) as view:
                for at in range(0, len(view), 8 * MiB):
                    with view[at : at + 8 * MiB] as chunk:
                        sha.update(chunk)
                        os.pwrite(fd, chunk, written)
                    written += 8 * MiB
        os.fsync(fd)
    finally:
        os.close(fd)
    cpu = time.thread_time() - cpu0
    dst.unlink()
    src.unlink()
    return cpu / (written / 1e9)


class Minimum:
    """The bare minimum, measured again around every run: `around(run)` runs it between the
    measurement before (the last one taken) and one after, and returns its rows, each with the mean of
    the two as "min_cpu_s_per_gb"."""

    def __init__(self, shm: Path, folder: Path, total_bytes: int):
        self.shm, self.folder, self.total_bytes = shm, folder, total_bytes
        self.measured: list[float] = []

    def measure(self) -> float:
        self.measured.append(minimum_cost(self.shm, self.folder, self.total_bytes))
        return self.measured[-1]

    def around(self, run) -> tuple[dict, ...]:
        before = self.measured[-1] if self.measured else self.measure()
        rows = run()
        after = self.measure()
        for r in rows:
            r["min_cpu_s_per_gb"] = (before + after) / 2
        return rows


def staged_samples(shm: Path, count: int, tokens: int, layers: list[int], hidden: int) -> list[ShardSample]:
    """`count` dumps written to /dev/shm as the reference server writes them, reopened as the service
    reopens staged dumps (load_staged): each layer a span of its dump file."""
    dumper = Dumper(shm / "staged", boot_id="bench", dtype_name="bfloat16", hidden_size=hidden)
    gen = torch.Generator().manual_seed(0)
    out = []
    for k in range(count):
        ids = torch.randint(0, 32000, (tokens,), generator=gen).tolist()
        hidden_states = {i: torch.randn(tokens, hidden, generator=gen).bfloat16() for i in layers}
        d = dumper.write(str(k), rid=f"w{k}", counter=k, input_ids=ids, hidden_states=hidden_states)
        dump = load_staged(d)
        out.append(ShardSample(f"w{k}", np.asarray(ids, dtype=np.int64), np.ones(tokens, np.int64), dump.layers))
    return out


def writer_alone(args, work: Path, shm: Path, flushers: int, shards: list[list[ShardSample]]) -> dict:
    """write_shard alone, as the service's flushers call it: `flushers` threads, each writing its own
    shards (every flushers-th), from staged dumps in /dev/shm to the output disk."""
    out = work / f"writer-{flushers}"
    layers = list(range(args.layers))
    nbytes = 0

    def flusher(first: int) -> int:
        done = 0
        for k in range(first, len(shards), flushers):
            done += write_shard(out / shard_name(k), shards[k], layers, "bfloat16", args.hidden).bytes
        return done

    os.sync()
    cpu0, start = time.process_time(), time.perf_counter()
    with ThreadPoolExecutor(flushers, thread_name_prefix="flusher") as pool:
        nbytes = sum(pool.map(flusher, range(flushers)))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    shutil.rmtree(out)
    return {"flushers": flushers, "gb": nbytes / 1e9, "gb_s": nbytes / wall / 1e9, "cpu_s_per_gb": cpu / (nbytes / 1e9)}


def writer_report(args, work: Path, shm: Path, report: Report) -> None:
    """The shard writer alone with one flusher and with two, against the disk's O_DIRECT rate
    measured just before and just after them (as many bytes as each writes)."""
    per_sample = args.tokens * args.layers * args.hidden * 2
    pool = staged_samples(shm, args.writer_staged, args.tokens, list(range(args.layers)), args.hidden)
    per_shard = max(1, Settings.model_fields["shard_max_bytes"].default // per_sample)
    count = max(2, -(-int(args.writer_gb * 1e9) // (per_shard * per_sample)))
    count += count % 2  # two flushers get as many shards each
    shards = [[pool[(k * per_shard + j) % len(pool)] for j in range(per_shard)] for k in range(count)]
    volume = count * per_shard * per_sample
    minimum = Minimum(shm, work, volume)
    directs = [disk_write_rates(work, volume)[1]]
    runs = minimum.around(lambda: tuple(writer_alone(args, work, shm, n, shards) for n in (1, 2)))
    directs.append(disk_write_rates(work, volume)[1])
    direct = statistics.median(directs)
    before, after = minimum.measured
    print(
        f"shard writer alone: {count} shards of {per_shard} staged dumps ({per_shard * per_sample / MiB:.0f} MiB), "
        f"{volume / 1e9:.1f} GB per run, from /dev/shm to the output disk; the disk's O_DIRECT rate "
        f"{direct / 1e9:.2f} GB/s (before {directs[0] / 1e9:.2f}, after {directs[1] / 1e9:.2f}); the bare minimum "
        f"(one O_DIRECT copy + one sha256 pass, one thread) {runs[0]['min_cpu_s_per_gb']:.2f} CPU s/GB (before "
        f"{before:.2f}, after {after:.2f})"
    )
    table = report.table(
        "shard_writer",
        Column("flushers", "flushers", left=True),
        Column("gb_s", "GB/s", ".2f"),
        Column("cpu_s_per_gb", "CPU s/GB", ".2f"),
        Column("x_min", "x min", ".2f"),
        Column("of_direct", "of O_DIRECT", ".0%"),
        Column("x_one", "x 1 flusher", ".2f"),
    )
    for r in runs:
        r["x_min"] = r["cpu_s_per_gb"] / r["min_cpu_s_per_gb"]
        r["of_direct"] = r["gb_s"] * 1e9 / direct
        r["x_one"] = r["gb_s"] / runs[0]["gb_s"]
        table.add(**r)
    report.figure("disk_o_direct_gb_s", direct / 1e9)
    print(
        "targets: 2 flushers >= 80% of the O_DIRECT rate, or >= 1.8x one flusher where the disk is faster than "
        "two cores can hash"
    )


class Bench:
    def __init__(self, args, work: Path, shm: Path):
        self.args = args
        self.work = work
        self.shm = shm
        rng = random.Random(0)
        self.samples = [
            {"id": f"b{i}", "input_ids": [rng.randrange(32000) for _ in range(args.tokens)]}
            for i in range(args.samples)
        ]
        self.bytes_per_sample = args.tokens * args.layers * args.hidden * 2

    def server(self, name: str, prefill_us: float, rid: bool) -> tuple[Process, str, Path]:
        port = free_port()
        root = self.shm / f"{name}-dumps"
        layers = ",".join(str(i) for i in [2, 16, 29, 32][: self.args.layers])
        args = hsx_command() + [
            "reference-server",
            "--synthetic",
            "--hidden-size",
            str(self.args.hidden),
            "--num-layers",
            "32",
            "--layers",
            layers,
            "--dump-root",
            str(root),
            "--port",
            str(port),
            "--prefill-us-per-token",
            str(prefill_us),
            "--skip-server-warmup",
        ]
        if rid:
            args += ["--name-by", "rid", "--max-batch", str(self.args.in_flight)]
        proc = Process(args, self.work / f"{name}-reference.log")
        url = f"http://127.0.0.1:{port}"
        proc.wait_http(url + "/health")
        return proc, url, root

    def bare(self, prefill_us: float, durable: bool = False) -> tuple[dict, ...]:
        """The first pipeline's loop. Plain: timed to its last save (its files may still be in the
        page cache) and, from the same run, until they are on disk (every file fsynced after the
        loop). Durable: each file fsynced as it is saved."""
        ref, url, root = self.server("bare", prefill_us, rid=False)
        out = self.work / "bare-out"
        out.mkdir()
        files = [out / f"sample_{i}.safetensors" for i in range(len(self.samples))]
        with httpx.Client(timeout=600) as c:

            def one(s: dict, path: Path) -> None:
                for d in root.glob("req_*"):
                    shutil.rmtree(d)
                c.post(url + "/generate", json={"input_ids": s["input_ids"], "sampling_params": {"max_new_tokens": 0}})
                done = []
                while not done:
                    done = [d for d in root.glob("req_*") if (d / "done").exists()]
                tensors = load_file(done[0] / "hidden_states.safetensors")
                save_file(tensors, path)
                if durable:
                    fsync_path(path)

            one(self.samples[0], out / "warm-up.safetensors")  # as the service's runs do: see service()
            os.sync()  # no run pays for the writeback of the one before it
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            start = time.perf_counter()
            for s, path in zip(self.samples, files):
                one(s, path)
        saved = time.perf_counter() - start
        for path in files:
            fsync_path(path)
        on_disk = time.perf_counter() - start
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        ref.stop()
        shutil.rmtree(out)
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        if durable:
            return (self._figures("bare loop, fsync each file", on_disk, cpu, r1.ru_maxrss * 1024),)
        return (
            self._figures("bare loop, in page cache", saved, cpu, r1.ru_maxrss * 1024),
            self._figures("bare loop, until on disk", on_disk, cpu, r1.ru_maxrss * 1024),
        )

    def service(self, name: str, prefill_us: float, rid: bool) -> dict:
        ref, url, root = self.server(name, prefill_us, rid=rid)
        port = free_port()
        out = self.work / f"{name}-out"
        args = hsx_command() + [
            "serve",
            "--backend-url",
            url,
            "--dump-root",
            str(root),
            "--output-root",
            str(out),
            "--input-root",
            str(self.work),
            "--database-url",
            self.database_url(name),
            "--port",
            str(port),
            "--max-in-flight",
            str(self.args.in_flight),
            "--log-level",
            "warning",
        ]
        svc = Process(args, self.work / f"{name}-service.log")
        svc_url = f"http://127.0.0.1:{port}"
        svc.wait_http(svc_url + "/healthz")
        body = "".join(json.dumps(s) + "\n" for s in self.samples).encode()
        with httpx.Client(timeout=600) as c, HsxClient(svc_url, timeout=600) as hsx:
            # A service that has been up a while has done each kind of work before: one sample goes through
            # first, unmeasured, so that what a process does once (a route's first request, its first
            # statements, its first shard) is not counted against a run of a few samples.
            # The synthetic server captures the first --layers of EAGLE-3's: the jobs take whatever it gives.
            warm = hsx.create_job(
                [{"id": "warm-up", "input_ids": self.samples[0]["input_ids"]}], name="warm-up", layers="any"
            )
            assert hsx.wait(warm.id, poll_s=0.05, max_poll_s=0.05).state == "succeeded"
            os.sync()
            cpu0 = proc_tree_cpu(svc.proc.pid)
            started = datetime.now(timezone.utc)
            job = c.post(
                svc_url + "/v1/jobs",
                params={"layers": "any"},
                content=body,
                headers={"content-type": "application/x-ndjson"},
            ).json()
            # Waited on as `hsx status --watch` does (polls every 0.5 s, then every second): the service's
            # CPU includes answering a user's polls, not those of a client polling as fast as it can.
            state = hsx.wait(job["id"], poll_s=0.5, max_poll_s=1.0)
        # The job's own finishing time, not when a poll saw it.
        assert state.finished_at is not None, state
        wall = (state.finished_at - started).total_seconds()
        cpu1, (_, rss) = proc_tree_cpu(svc.proc.pid), proc_cpu_and_rss(svc.proc.pid)
        svc.stop()
        ref.stop()
        assert state.state == "succeeded", state
        shutil.rmtree(out)
        # A database remembers its output root, which is gone: the next run starts with neither.
        for f in self.database_path(name).parent.glob(self.database_path(name).name + "*"):
            f.unlink()
        label = f"service, {'rid mode, ' + str(self.args.in_flight) + ' in flight' if rid else 'clear-and-scan'}"
        return (self._figures(label, wall, cpu1 - cpu0, rss),)

    def database_path(self, name: str) -> Path:
        return (self.shm if self.args.database_on == "shm" else self.work) / f"{name}.db"

    def database_url(self, name: str) -> str:
        return f"sqlite:///{self.database_path(name)}"

    def _figures(self, label: str, wall: float, cpu: float, rss: int) -> dict:
        n = len(self.samples)
        return {
            "run": label,
            "samples_s": n / wall,
            "tokens_s": n * self.args.tokens / wall,
            "gb_s": n * self.bytes_per_sample / wall / 1e9,
            "cpu_s_per_sample": cpu / n,
            "cpu_s_per_gb": cpu / (n * self.bytes_per_sample / 1e9),
            "peak_rss_mib": rss / MiB,
            "wall_s": wall,
        }


def runs_table(report: Report, rows: list[dict], disk: float, minimums: list[float]) -> None:
    report.figure("disk_gb_s", disk / 1e9)
    report.figure("minimum_cpu_s_per_gb", statistics.median(minimums))
    table = report.table(
        "runs",
        Column("scenario", "scenario", left=True),
        Column("run", "run", left=True),
        Column("samples_s", "samples/s", ".2f"),
        Column("tokens_s", "tokens/s", ".0f"),
        Column("gb_s", "GB/s", ".2f"),
        Column("cpu_s_per_sample", "CPU s/smp", ".3f"),
        Column("cpu_s_per_gb", "CPU s/GB", ".2f"),
        Column("min_cpu_s_per_gb", "min", ".2f"),
        Column("x_min", "x min", ".2f"),
        Column("peak_rss_mib", "RSS MiB", ".0f"),
        Column("vs_bare", "x bare", ".2f"),
        Column("vs_serial", "x serial", ".2f"),
        Column("vs_disk", "of disk", ".0%"),
    )
    for r in rows:
        r["x_min"] = r["cpu_s_per_gb"] / r["min_cpu_s_per_gb"]
        table.add(**r)


def median_run(runs: list[tuple[dict, ...]]) -> tuple[dict, ...]:
    """The run whose last row has the median rate (a run may give several rows)."""
    return sorted(runs, key=lambda r: r[-1]["samples_s"])[len(runs) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=1, help="runs per row; the median is reported")
    parser.add_argument(
        "--database-on",
        choices=["disk", "shm"],
        default="disk",
        help="where the service's SQLite file lives: on the output disk, or in /dev/shm (as a "
        "database on other storage would be)",
    )
    parser.add_argument("--output-dir", default=".", help="a folder on the disk to measure (default: here)")
    parser.add_argument(
        "--only",
        choices=["all", "writer"],
        default="all",
        help="writer: only the shard writer alone (1 and 2 flushers) and the bare minimum (default: %(default)s)",
    )
    parser.add_argument("--writer-gb", type=float, default=4.0, help="GB each shard-writer run writes (default: 4)")
    parser.add_argument(
        "--writer-staged",
        type=int,
        default=8,
        help="distinct staged dumps in /dev/shm the shard-writer runs take their samples from, in turn (default: 8)",
    )
    parser.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=None,
        help="simulated prefill time for the 'comparable' runs (default: the bare loop's time "
        "per sample with an instant server)",
    )
    add_json_argument(parser)
    args = parser.parse_args(argv)
    report = Report("bench_throughput", args)
    with (
        tempfile.TemporaryDirectory(prefix="hsx-bench-", dir=args.output_dir) as tmp,
        tempfile.TemporaryDirectory(prefix="hsx-bench-", dir="/dev/shm") as shm,
    ):
        work = Path(tmp)
        if args.only == "writer":
            writer_report(args, work, Path(shm), report)
            report.write()
            return 0
        bench = Bench(args, work, Path(shm))
        volume = bench.bytes_per_sample * args.samples
        disks = [disk_write_rate(work, volume)]
        minimum = Minimum(Path(shm), work, volume)
        print(
            f"machine: {os.cpu_count()} cores; sample: {args.tokens} tokens x {args.layers} layers x hidden "
            f"{args.hidden} bf16 = {bench.bytes_per_sample / MiB:.1f} MiB; {args.samples} samples per run, "
            f"each row the median of {args.repeat} run(s)"
        )
        print(
            f"disk: sequential write {disks[0] / 1e9:.2f} GB/s ({volume / 1e9:.1f} GB in 8 MiB writes + fsync, "
            f"the better of buffered and O_DIRECT)"
        )
        rows = []
        prefill_us = args.prefill_us_per_token
        for scenario, times in (("instant server", 0), ("prefill ~ persist", 1), ("prefill ~ 4x persist", 4)):
            if times and prefill_us is None:
                # What persisting costs the first pipeline: its time per sample with an instant server.
                bare = next(r for r in rows if r["run"] == "bare loop, until on disk")
                prefill_us = bare["wall_s"] / args.samples / args.tokens * 1e6
                print(
                    f"'comparable' prefill = the bare loop's time per sample with an instant server: "
                    f"{prefill_us:.1f} us/token ({prefill_us * args.tokens / 1000:.0f} ms per sample)"
                )
            us = times * (prefill_us or 0.0)
            runs = [
                partial(bench.bare, us),
                partial(bench.bare, us, durable=True),
                partial(bench.service, "serial", us, rid=False),
                partial(bench.service, "rid", us, rid=True),
            ]
            got = [r for run in runs for r in median_run([minimum.around(run) for _ in range(args.repeat)])]
            bare = next(r for r in got if r["run"] == "bare loop, until on disk")
            serial = next(r for r in got if r["run"].startswith("service, clear"))
            for r in got:
                r["scenario"] = scenario
                r["vs_bare"] = r["samples_s"] / bare["samples_s"]
                r["vs_serial"] = r["samples_s"] / serial["samples_s"]
                rows.append(r)
            disks.append(disk_write_rate(work, volume))
        disk = statistics.median(disks)
        for r in rows:
            r["vs_disk"] = r["gb_s"] * 1e9 / disk
        print(
            f"disk, measured after each scenario too: median {disk / 1e9:.2f} GB/s "
            f"(range {min(disks) / 1e9:.2f}-{max(disks) / 1e9:.2f}); 'of disk' below is against the median"
        )
        print(
            f"the bare minimum on the same bytes (one O_DIRECT copy from /dev/shm + one sha256 pass, one thread), "
            f"measured before and after every run: median {statistics.median(minimum.measured):.2f} CPU s/GB "
            f"(range {min(minimum.measured):.2f}-{max(minimum.measured):.2f}); 'x min' below is a row's CPU s/GB "
            f"against 'min', the mean of the two measurements around its run (target for the service: <= 1.3)"
        )
        runs_table(report, rows, disk, minimum.measured)
        writer_report(args, work, Path(shm), report)
    report.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
